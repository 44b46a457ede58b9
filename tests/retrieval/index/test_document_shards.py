"""Document shards of an index: the merged answer of the shards equals the unsharded one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.search import Candidates, SearchPlan, run_search
from retrieval.index.split import check_cover, shard_of, split_index
from support.topk_check import assert_same_topk

FILTERS = [
    None,
    "shard in {0,1,2,3} and bucket in {0,1,2,3,4,5}",
    "shard = 0 and bucket = 0",  # ~20 items: the plan scans exactly
    "not shard in {0,1,2} and bucket != 5",
]


@pytest.fixture(scope="module", params=[("int8", 200), ("fp8", 0)], ids=["int8-rerank", "fp8"])
def index(request, catalog) -> IVFIndex:
    codes, rerank = request.param
    cfg = IVFConfig(nlist=64, nprobe=8, codes=codes, rerank=rerank)
    return build_ivf(
        catalog["x"], cfg, item_attributes=catalog["attrs"], attribute_values=catalog["values"]
    )


def sharded_search(stats: IVFIndex, shards: list[IVFIndex], q, k, text, exact=False):
    """What the router does, in one process: plan on the statistics, merge shard candidates."""
    fb = stats.compile_filter(text, q.shape[0])
    cfg = stats.config
    plan = stats.plan(fb, k, cfg.nprobe, cfg.rerank, exact)

    def fetch(p: SearchPlan, rows):
        qq, f = (q, fb) if rows is None else (q[rows], FilterBatch(fb.masks[rows], fb.negate[rows]))
        return Candidates.concat([s.item_candidates(qq, f, p) for s in shards])

    top = run_search(plan, fetch)
    return top.keys, top.scores


@pytest.mark.parametrize("num_shards", [1, 2, 3])
@pytest.mark.parametrize("text", FILTERS)
@pytest.mark.parametrize("k", [10, 1000, 10_000])
def test_sharded_equals_unsharded(index, catalog, num_shards, text, k):
    q = catalog["q"][:16]
    stats, shards = split_index(index, shard_of(index.item_ids, num_shards), num_shards)
    ids, scores = sharded_search(stats, shards, q, k, text)
    want_ids, want_scores = index.search(q, k, text)
    assert_same_topk(ids, scores, want_ids, want_scores)


def test_sharded_exact_equals_unsharded_exact(index, catalog):
    q = catalog["q"][:8]
    stats, shards = split_index(index, shard_of(index.item_ids, 2), 2)
    fb = index.compile_filter(FILTERS[1], 8)
    pos, want = index.search_positions(q, 100, fb, 1, 0, exact=True)
    ids, scores = sharded_search(stats, shards, q, 100, FILTERS[1], exact=True)
    assert_same_topk(ids, scores, index.item_ids[pos], want)


def test_shards_are_disjoint_and_keep_the_centroids(index):
    stats, shards = split_index(index, shard_of(index.item_ids, 3), 3)
    assert sum(s.ntotal for s in shards) == index.ntotal == stats.ntotal
    assert stats.item_ids.numel() == 0 and stats.codes.numel() == 0
    for s in shards:
        assert torch.equal(s.centroids, index.centroids)
        assert s.nlist == index.nlist


def test_a_shard_survives_a_state_dict_round_trip(index, catalog):
    _, shards = split_index(index, shard_of(index.item_ids, 2), 2)
    fresh = IVFIndex(index.config, index.dim, index.schema.attribute_values)
    fresh.load_state_dict(shards[1].state_dict())
    assert torch.equal(fresh.item_ids, shards[1].item_ids)
    q = catalog["q"][:4]
    assert torch.equal(fresh.search(q, 5)[0], shards[1].search(q, 5)[0])


def test_an_assignment_outside_the_shards_is_refused(index):
    bad = torch.zeros(index.ntotal, dtype=torch.int64)
    bad[7] = 5
    with pytest.raises(ValueError, match="no shard in"):
        split_index(index, bad, 2)
    with pytest.raises(ValueError, match="one shard per item"):
        split_index(index, bad[:-1], 2)


def test_a_map_missing_an_item_or_holding_one_twice_is_refused():
    ids = torch.arange(10)
    with pytest.raises(ValueError, match="on no shard"):
        check_cover(ids, [ids[:4], ids[5:]])
    with pytest.raises(ValueError, match="more than one shard"):
        check_cover(ids, [ids[:6], ids[5:]])


@given(st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=200), st.integers(1, 64))
def test_shard_of_is_stable_and_in_range(ids, n):
    t = torch.tensor(ids)
    a = shard_of(t, n)
    assert ((a >= 0) & (a < n)).all()
    assert torch.equal(a, shard_of(t.flip(0), n).flip(0))  # depends on the id only


def test_shard_of_spreads_ids_evenly():
    counts = torch.bincount(shard_of(torch.arange(100_000), 4), minlength=4)
    assert counts.min() > 0.95 * 25_000
