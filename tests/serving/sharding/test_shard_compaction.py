"""Compaction of a document shard's fresh segment (serving/live/compactor.py, the shard's swap), in one
process: a commit past ``compact_at`` folds the part in the background at the same sequence and
it answers exactly as before (and as the unsharded model); a prepare pending while a fold swaps
in is rebased onto it; a restarted shard replaying the router's records (what a kill -9 during a
compaction leaves) serves the same items and answers."""

from __future__ import annotations

import torch

from retrieval.filters import FilterBatch
from retrieval.index.compaction import fold
from retrieval.index.ivf import IVFIndex
from retrieval.index.live_index import served_ids
from retrieval.index.search import Candidates, run_search
from retrieval.index.split import shard_of, split_index
from retrieval.live_updates import prepare_update, resolve_update
from retrieval.model import RetrievalModel
from serving.live.messages import to_record
from serving.sharding.shard_parts import ShardParts
from support.topk_check import assert_same_topk
from support.waiting import wait_until
from tests.retrieval.test_live_shards import FILTERS, batches
from tests.retrieval.test_live_updates import query, setup  # noqa: F401

SHARDS = 2
TOL = 0.05
"""Score tolerance: a folded row is scored from the main lists' codes, a fresh row from its
float vector (the tiny model's scores are a few units)."""


def started(model: RetrievalModel, compact_at: int) -> tuple[IVFIndex, list[ShardParts]]:
    """The statistics index and ``SHARDS`` shards' parts of ``model`` (version 1, update 0)."""
    ids = model.index.item_ids
    stats, parts = split_index(model.index, shard_of(ids, SHARDS), SHARDS)
    held = []
    for s, part in enumerate(parts):
        p = ShardParts("demo", s, keep=1, compact_at=compact_at)
        p.add(1, part, SHARDS)
        held.append(p)
    return stats, held


def apply(shards: list[ShardParts], record: bytes, sequence: int) -> None:
    """One update as the router sends it: prepared on every shard, then committed."""
    for p in shards:
        p.prepare("demo", 1, sequence, record, f"a{sequence}")
    for p in shards:
        p.commit("demo", 1, sequence, f"a{sequence}")


def records(model: RetrievalModel, prep) -> list[bytes]:
    out = []
    for s, batch in enumerate(batches(prep, model), start=1):
        out.append(to_record(resolve_update(model, batch).resolved, s).SerializeToString())
    return out


def exact(stats: IVFIndex, parts: list[IVFIndex], q: torch.Tensor, k: int, text):
    """The router's exact search over ``parts`` (plan on the statistics, merged candidates)."""
    fb = stats.compile_filter(text, q.shape[0])
    fb = FilterBatch(fb.masks, fb.negate, None)
    plan = stats.plan(fb, stats.params(k, exact=True), q=q)

    def fetch(p, rows):
        qq, f = (q, fb) if rows is None else (q[rows], fb.rows(rows))
        return Candidates.concat([s.item_candidates(qq, f, p) for s in parts])

    top = run_search(plan, fetch)
    return top.keys, top.scores


def current(shards: list[ShardParts]) -> list[IVFIndex]:
    return [p.versions[1].index for p in shards]


def test_a_shard_folds_its_segment_and_answers_as_the_unsharded_model(setup):  # noqa: F811
    prep, model = setup
    stats, shards = started(model, compact_at=3)
    whole = model
    for s, (record, batch) in enumerate(
        zip(records(model, prep), batches(prep, model), strict=True), 1
    ):
        apply(shards, record, s)
        whole = prepare_update(whole, batch).commit()
        wait_until(lambda: not any(p.compactor.running for p in shards), 30, "compactions")
    assert sum(p.compactor.done for p in shards) >= 1
    assert [p.sequences() for p in shards] == [{1: 4}] * SHARDS  # folded at the same sequence
    parts = current(shards)
    assert sum(p.ntotal for p in parts) > model.index.ntotal - 2  # the fresh rows joined lists
    held = torch.cat([served_ids(p) for p in parts])
    assert sorted(held.tolist()) == served_ids(whole.index).tolist()
    q = torch.stack([query(model, prep)] * 2) + torch.randn(2, model.index.dim) * 0.1
    for text in FILTERS:
        want_ids, want_scores = whole.index.search(q, 20, text, exact=True)
        ids, scores = exact(stats, parts, q, 20, text)
        assert_same_topk(ids, scores, want_ids, want_scores, TOL)


def test_a_prepare_pending_while_a_fold_swaps_in_keeps_the_fold(setup):  # noqa: F811
    prep, model = setup
    stats, shards = started(model, compact_at=0)  # folds by hand below
    recs = records(model, prep)
    for s, record in enumerate(recs[:2], 1):
        apply(shards, record, s)
    bases = current(shards)
    folds = [fold(b) for b in bases]
    for p in shards:
        p.prepare("demo", 1, 3, recs[2], "a3")  # pending while the folds swap in
    for p, base, folded in zip(shards, bases, folds, strict=True):
        assert p._swap_folded(1, base, folded)
    for p in shards:
        p.commit("demo", 1, 3, "a3")
    apply(shards, recs[3], 4)
    folded_parts = current(shards)
    assert [p.ntotal for p in folded_parts] == [f.ntotal for f in folds]  # the fold kept
    _, replayed = started(model, compact_at=0)  # a shard restarted: the router's log again
    for s, record in enumerate(recs, 1):
        apply(replayed, record, s)
    plain = current(replayed)
    assert [served_ids(a).tolist() for a in folded_parts] == [served_ids(b).tolist() for b in plain]
    q = torch.stack([query(model, prep)] * 2) + torch.randn(2, model.index.dim) * 0.1
    for text in FILTERS:
        want_ids, want_scores = exact(stats, plain, q, 20, text)
        ids, scores = exact(stats, folded_parts, q, 20, text)
        assert_same_topk(ids, scores, want_ids, want_scores, TOL)
