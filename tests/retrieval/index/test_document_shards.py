"""Document shards of an index: the merged answer of the shards equals the unsharded one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.plan import SearchPlan
from retrieval.index.search import Candidates, run_search
from retrieval.index.split import check_cover, merge_shards, shard_of, shard_rows, split_index
from retrieval.index.update import add_items
from support.topk_check import assert_same_topk

FILTERS = [
    None,
    "shard in {0,1,2,3} and bucket in {0,1,2,3,4,5}",
    "shard = 0 and bucket = 0",  # ~20 items: the plan scans exactly
    "not shard in {0,1,2} and bucket != 5",
]


@pytest.fixture(
    scope="module",
    params=[("int8", 200, "float16"), ("fp8", 0, "none")],
    ids=["int8-rerank", "fp8-no-exact-copy"],
)
def index(request, catalog) -> IVFIndex:
    codes, rerank, exact_copy = request.param
    cfg = IVFConfig(nlist=64, nprobe=8, codes=codes, rerank=rerank, exact_copy=exact_copy)
    return build_ivf(
        catalog["x"], cfg, item_attributes=catalog["attrs"], attribute_values=catalog["values"]
    )


def sharded_search(stats: IVFIndex, shards: list[IVFIndex], q, k, text, exact=False):
    """What the router does, in one process: plan on the statistics, merge shard candidates."""
    fb = stats.compile_filter(text, q.shape[0])
    cfg = stats.config
    plan = stats.plan(fb, stats.params(k, cfg.nprobe, cfg.rerank, exact=exact), q=q)

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
    pos, want = index.search(q, 100, fb, nprobe=1, rerank=0, exact=True, positions=True)
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


def assert_same_index(got: IVFIndex, want: IVFIndex) -> None:
    """Every buffer equal, bit for bit, and the same search settings and filter schema."""
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    for name, t in b.items():
        if isinstance(t, torch.Tensor):
            assert a[name].dtype == t.dtype and torch.equal(a[name], t), name
        else:
            assert a[name] == t, name
    assert got.ntotal == want.ntotal and got.max_list == want.max_list
    assert got.posting_offsets == want.posting_offsets


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.integers(1, 6), st.integers(0, 2**31), st.booleans())
def test_split_then_merge_is_the_original(index, num_shards, seed, hashed):
    g = torch.Generator().manual_seed(seed)
    assignment = (
        shard_of(index.item_ids, num_shards)
        if hashed
        else torch.randint(0, num_shards, (index.ntotal,), generator=g)  # shards may be empty
    )
    stats, parts = split_index(index, assignment, num_shards)
    assert_same_index(merge_shards(parts, stats, shard_rows(assignment, num_shards)), index)
    # without the rows, lists come back in item-id order: the order of a fresh build
    assert_same_index(merge_shards(parts, stats), index)


def test_merge_restores_the_order_of_an_updated_index(index, catalog):
    """Items replaced after the build move to the end of their lists, out of item-id order: only
    the shards' rows restore that order."""
    new_ids = torch.tensor([5, 3, 1])
    vecs = catalog["x"][:3] + 0.01
    updated = add_items(index, new_ids, vecs, index.sig[:3].clone())
    assignment = shard_of(updated.item_ids, 3)
    stats, parts = split_index(updated, assignment, 3)
    assert_same_index(merge_shards(parts, stats, shard_rows(assignment, 3)), updated)
    by_id = merge_shards(parts, stats)
    assert not torch.equal(by_id.item_ids, updated.item_ids)
    q = catalog["q"][:8]
    assert_same_topk(*by_id.search(q, 50, FILTERS[1]), *updated.search(q, 50, FILTERS[1]))


def test_shards_that_do_not_fit_the_router_are_refused(index):
    assignment = shard_of(index.item_ids, 2)
    stats, parts = split_index(index, assignment, 2)
    rows = shard_rows(assignment, 2)
    with pytest.raises(ValueError, match="the router counts"):
        merge_shards(parts[:1], stats)
    with pytest.raises(ValueError, match="do not cover the index once"):
        merge_shards(parts, stats, [rows[0], rows[0][: parts[1].ntotal]])
    with pytest.raises(ValueError, match="shard 0: its rows put items in other lists"):
        merge_shards(parts, stats, rows[::-1] if parts[0].ntotal == parts[1].ntotal else
                     [rows[0].flip(0), rows[1]])  # fmt: skip
