"""Live updates of document shards (retrieval/live_shards.py): the same resolved batch applied to
every shard's part answers as the unsharded model updated with it; an item no shard holds is
refused; the router's statistics are the parts' sums, its bound statistics the unsharded ones."""

from __future__ import annotations

import pytest
import torch

from retrieval.filters import FilterBatch
from retrieval.index.ivf import IVFIndex
from retrieval.index.live_index import locate, served_ids
from retrieval.index.plan import SearchPlan
from retrieval.index.search import Candidates, run_search
from retrieval.index.split import shard_of, split_index
from retrieval.index.update import list_sizes
from retrieval.live_shards import check_held, stats_index, update_shard
from retrieval.live_updates import (
    RemoveItems,
    SetItemAttributes,
    UpdateEmbeddings,
    UpdateError,
    UpsertItems,
    prepare_update,
    resolve_update,
)
from retrieval.model import RetrievalModel
from retrieval.training.prepare import Prepared
from support.topk_check import assert_same_topk
from tests.retrieval.test_live_updates import attributes_of, query, setup  # noqa: F401

FILTERS = [None, "available = 'true'", "not available = 'true'"]


def sharded_search(
    stats: IVFIndex, parts: list[IVFIndex], q: torch.Tensor, k: int, text, seen=None
):
    """The router's search in one process: plan on the statistics, merge the parts' candidates
    (``seen [B, S]``: items each row excludes)."""
    fb = stats.compile_filter(text, q.shape[0])
    fb = FilterBatch(fb.masks, fb.negate, seen)
    plan = stats.plan(fb, stats.params(k), q=q)

    def fetch(p: SearchPlan, rows):
        qq, f = (q, fb) if rows is None else (q[rows], fb.rows(rows))
        return Candidates.concat([s.item_candidates(qq, f, p) for s in parts])

    top = run_search(plan, fetch)
    return top.keys, top.scores


def routed(model: RetrievalModel, parts: list[IVFIndex], stats: IVFIndex, batch):
    """One update as the router and its shards run it -> (parts, stats) after it."""
    resolved = resolve_update(model, batch).resolved
    done = [update_shard(p, resolved, s, len(parts)) for s, p in enumerate(parts)]
    sizes = torch.stack([d.list_sizes() for d in done]).sum(0)
    check_held(resolved, [d.held for d in done], sum(d.served() for d in done))
    counts = torch.stack([d.bit_counts() for d in done]).sum(0)
    return [d.index for d in done], stats_index(stats, sizes, counts, resolved)


def batches(prep: Prepared, model: RetrievalModel) -> list:
    dim = model.index.dim
    gen = torch.Generator().manual_seed(3)
    new = torch.tensor([10_001, 10_002, 10_003])
    attrs = [attributes_of(prep, i) for i in range(3)]
    return [
        UpsertItems(new, attrs, torch.randn(3, dim, generator=gen) * 3),  # new items, vectors
        UpsertItems(torch.tensor([5, 6, 7]), [attributes_of(prep, i) for i in (5, 6, 7)]),  # tower
        RemoveItems(torch.tensor([1, 2, 10_002])),
        SetItemAttributes(
            torch.tensor([0, 3, 4, 10_001]),
            [{"available": ("false",)}] * 2 + [{"available": ("true",)}] * 2,
        ),
    ]


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_routed_updates_answer_as_the_unsharded_model(setup, num_shards):  # noqa: F811
    prep, model = setup
    whole = model
    stats, parts = split_index(model.index, shard_of(model.index.item_ids, num_shards), num_shards)
    q = torch.stack([query(model, prep)] * 2) + torch.randn(2, model.index.dim) * 0.1
    for batch in batches(prep, model):
        whole = prepare_update(whole, batch).commit()
        parts, stats = routed(model, parts, stats, batch)
        assert torch.equal(stats.offsets, whole.index.offsets)
        assert torch.equal(stats.bit_counts, whole.index.bit_counts)
        assert torch.equal(stats.list_radius, whole.index.list_radius)  # the bound statistics
        assert torch.equal(stats.list_bits, whole.index.list_bits)
        held = torch.cat([served_ids(p) for p in parts])
        assert sorted(held.tolist()) == served_ids(whole.index).tolist()
        for text in FILTERS:
            for k in (10, 250):
                want_ids, want_scores = whole.index.search(q, k, text)
                ids, scores = sharded_search(stats, parts, q, k, text)
                assert_same_topk(ids, scores, want_ids, want_scores)
            seen = torch.cat([want_ids[:, :5], torch.tensor([[10_001, 10_003]] * 2)], dim=1)
            fb = whole.index.compile_filter(text, 2)
            want_ids, want_scores = whole.index.search(
                q, 10, FilterBatch(fb.masks, fb.negate, seen)
            )
            ids, scores = sharded_search(stats, parts, q, 10, text, seen)
            assert_same_topk(ids, scores, want_ids, want_scores)


def test_an_upsert_moves_an_item_to_the_shard_its_id_hashes_to(setup):  # noqa: F811
    _, model = setup
    index = model.index
    wrong = (shard_of(index.item_ids, 2) + 1) % 2  # every item on the other shard
    stats, parts = split_index(index, wrong, 2)
    item = int(index.item_ids[0])
    before = [bool(locate(p, torch.tensor([item]))[0]) for p in parts]
    parts, stats = routed(model, parts, stats, UpsertItems(torch.tensor([item]), [{}]))
    after = [bool(locate(p, torch.tensor([item]))[0]) for p in parts]
    owner = int(shard_of(torch.tensor([item]), 2)[0])
    assert before[owner] is False and after == [s == owner for s in range(2)]
    assert int(list_sizes(stats).sum()) == index.ntotal


@pytest.mark.parametrize(
    "batch, message",
    [
        (RemoveItems(torch.tensor([0, 99_999])), "ids[1]: item 99999 is not in the index"),
        (
            SetItemAttributes(torch.tensor([99_998]), [{"available": ("true",)}]),
            "ids[0]: item 99998 is not in the index",
        ),
    ],
)
def test_an_item_no_shard_holds_is_refused(setup, batch, message):  # noqa: F811
    _, model = setup
    stats, parts = split_index(model.index, shard_of(model.index.item_ids, 2), 2)
    with pytest.raises(UpdateError, match=message.replace("[", r"\[").replace("]", r"\]")):
        routed(model, parts, stats, batch)


def test_removing_every_item_is_refused(setup):  # noqa: F811
    _, model = setup
    stats, parts = split_index(model.index, shard_of(model.index.item_ids, 2), 2)
    with pytest.raises(UpdateError, match="leave the index empty"):
        routed(model, parts, stats, RemoveItems(model.index.item_ids.clone()))


def test_the_router_checks_names_and_values_before_any_shard(setup):  # noqa: F811
    _, model = setup
    with pytest.raises(UpdateError, match=r"attributes\[0\].available: unknown value 'maybe'"):
        resolve_update(model, SetItemAttributes(torch.tensor([1]), [{"available": ("maybe",)}]))
    table = next(iter(model.tables.table_shapes()))
    with pytest.raises(UpdateError, match="rows"):
        resolve_update(model, UpdateEmbeddings(table, torch.tensor([10**9]), torch.zeros(1, 1)))


def test_a_table_update_leaves_every_shard_as_it_was(setup):  # noqa: F811
    _, model = setup
    _, parts = split_index(model.index, shard_of(model.index.item_ids, 2), 2)
    table, (_, width) = next(iter(model.tables.table_shapes().items()))
    batch = UpdateEmbeddings(table, torch.tensor([0]), torch.zeros(1, width))
    done = update_shard(parts[0], batch, 0, 2)
    assert done.index is parts[0] and done.held.numel() == 0
