"""The index's plain path (no filter clause, no target, no re-rank: the probe and the scan in two
C++ calls) answers exactly as the general path (planner, search rounds); the C++ probe picks the
lists the matmul + top-k picks."""

from __future__ import annotations

import pytest
import torch

from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index import ivf as ivf_module
from retrieval.index import plain as plain_module
from retrieval.index.plain import plain_search
from retrieval.index.planner import lists_for
from retrieval.index.probe import FEW_QUERIES, probe_lists
from retrieval.index.scan import scan


@pytest.fixture(scope="module", params=[("int8", "ip"), ("int8", "l2"), ("fp8", "ip")])
def index(request, catalog) -> IVFIndex:
    codes, probe = request.param
    cfg = IVFConfig(nlist=128, nprobe=8, codes=codes, probe=probe)
    return build_ivf(
        catalog["x"], cfg, item_attributes=catalog["attrs"], attribute_values=catalog["values"]
    )


def general(index: IVFIndex, q, k, fb, nprobe=8):
    """The general path (planner, search rounds)."""
    return index.planned_positions(q, k, fb, nprobe, 0)


@pytest.mark.parametrize("k", [1, 10, 100])
def test_the_plain_path_equals_the_general_one(index: IVFIndex, catalog, k: int) -> None:
    q = catalog["q"]
    for fb in (index.compile_filter(None, len(q)), None):
        got = plain_search(index, q, k, fb, 8, 0)
        assert got is not None
        want = general(index, q, k, index.compile_filter(None, len(q)))
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    ids, _ = index.search(q[:1], k)  # one query through the public entry
    assert torch.equal(ids, index.item_ids[want[0][:1]])


def test_excluded_items_and_a_large_k(index: IVFIndex, catalog) -> None:
    q = catalog["q"][:8]
    seen = index.search(q, 30)[0]  # each row's own best 30
    empty = index.compile_filter(None, len(q))
    fb = FilterBatch(empty.masks, empty.negate, exclude=seen)
    got = plain_search(index, q, 20, fb, 8, 0)
    assert got is not None
    want = general(index, q, 20, fb)
    assert torch.equal(got[0], want[0])
    assert not bool(torch.isin(index.item_ids[got[0]], seen).any())
    # rows with different counts of seen items: plain while their planned list counts agree
    # (as here: 20 + 30 items fit in 8 lists either way), the general path once they differ
    uneven = seen.clone()
    uneven[0, 5:] = -1
    fb_uneven = FilterBatch(fb.masks, fb.negate, uneven)
    got = plain_search(index, q, 20, fb_uneven, 8, 0)
    assert got is not None
    want = general(index, q, 20, fb_uneven)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not bool(torch.isin(index.item_ids[got[0][1:]], seen[1:]).any())
    k_wide = next(
        k
        for k in range(20, 2000)
        if lists_for(index, 1.0, 1, k + 5) != lists_for(index, 1.0, 1, k + 30)
    )
    assert plain_search(index, q, k_wide, fb_uneven, 1, 0) is None
    # a large k: the plan widens the lists to hold it, as the general plan does; rows the
    # lists leave short take the general path's later rounds
    q = catalog["q"]
    empty = index.compile_filter(None, len(q))
    coarse, lists = index.probe(q, 2)
    sizes = index.offsets.diff()[lists].sum(1)  # [B] items in each row's 2 lists
    short = int(sizes.min()) + 1  # more than some row's 2 lists hold
    first, _ = scan(q.contiguous(), lists, coarse, index.codes, index.scales, index.offsets,
                    index.sig, empty.masks, empty.negate, short, max_list=index.max_list)  # fmt: skip
    assert bool((first[:, -1] < 0).any())
    for k in (short, 2000):
        got = plain_search(index, q, k, None, 1, 0)
        assert got is not None and bool((got[0] >= 0).all())
        assert torch.equal(got[0], general(index, q, k, index.compile_filter(None, len(q)), 1)[0])


def test_filters_targets_and_rerank_take_the_general_path(index: IVFIndex, catalog) -> None:
    q = catalog["q"][:4]
    fb = index.compile_filter("shard in {1, 2}", len(q))
    assert plain_search(index, q, 10, fb, 8, 0) is None
    assert plain_search(index, q, 10, None, 8, 0, target=torch.full((4,), 0.9)) is None
    assert plain_search(index, q, 10, None, 8, 0, exact=True) is None


def test_the_cpu_probe_picks_the_matmul_lists(index: IVFIndex, catalog) -> None:
    q = catalog["q"]
    for half in (None, index.half_norms):
        coarse, lists = probe_lists(q, index.centroids, half, 8, index.centroids_t)
        ip = q @ index.centroids.T
        key = ip if half is None else ip - half
        want = key.topk(8, dim=1).indices
        assert torch.equal(lists, want)
        torch.testing.assert_close(coarse, ip.gather(1, want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 100, 2000])
def test_a_few_queries_search_in_one_call_as_the_general_path(index, catalog, monkeypatch, k):
    """``search`` on a few CPU queries (``plain.plain_search_ids``): one C++ call keyed by id for
    int8 codes, the same ids and scores as the general path; rows its lists leave short (k =
    2000 at nprobe 1) and fp8 codes fall back to the steps, with the same answer."""
    calls: list[int] = []
    real = plain_module.search_ids_cpu
    monkeypatch.setattr(
        plain_module, "search_ids_cpu", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q = catalog["q"][:FEW_QUERIES]
    seen = index.search(q, 5)[0]
    empty = index.compile_filter(None, len(q))
    for fb in (None, FilterBatch(empty.masks, empty.negate, exclude=seen)):
        calls.clear()
        ids, scores = index.search(q, k, fb, nprobe=1)
        pos, want = general(index, q, k, empty if fb is None else fb, 1)
        assert torch.equal(ids, torch.where(pos >= 0, index.item_ids[pos.clamp(min=0)], pos))
        torch.testing.assert_close(scores, want, rtol=0, atol=0)
        assert len(calls) == 1  # int8 answers in the call; fp8 and short rows go on after it


def test_the_public_fast_lane_answers_as_the_full_path(catalog, monkeypatch):
    """``search`` sends a few plain CPU queries to the C++ call before its full checks
    (``plain.plain_query_ids``): the same answer as the full path, an explicit ``rerank=0`` on a
    re-ranking index included; the index's own re-rank, and anything but the plainest
    arguments, take the full path (which explains refusals)."""
    index = build_ivf(catalog["x"], IVFConfig(nlist=64, nprobe=4, rerank=50))
    q = catalog["q"][:3]
    lanes: list[object] = []
    real = plain_module.plain_query_ids
    monkeypatch.setattr(
        plain_module, "plain_query_ids", lambda *a: lanes.append(out := real(*a)) or out
    )
    monkeypatch.setattr(ivf_module, "plain_query_ids", plain_module.plain_query_ids)
    ids, scores = index.search(q, 20, rerank=0)
    assert isinstance(lanes[-1], tuple)
    want = index._search_ids(q, 20, None, 4, 0, plain=False)
    assert torch.equal(ids, want[0]) and torch.equal(scores, want[1])
    lanes.clear()
    reranked = index.search(q, 20)  # the index re-ranks: the full path
    assert lanes == [False]
    assert torch.equal(reranked[0], index._search_ids(q, 20, None, 4, 50)[0])
    for bad in ({"k": 0}, {"k": 10**9}, {"nprobe": 0}):
        with pytest.raises(ValueError):
            index.search(q, **{"k": 20, **bad})
    np_ids, _ = index.search(q.numpy(), 20, rerank=0)  # NumPy: the full path, the same answer
    assert torch.equal(np_ids, ids)


def test_a_forced_kernel_leaves_the_one_call_to_the_steps(catalog, monkeypatch):
    """$RECSERVE_SCAN_KERNEL set (read by the C++ call itself): the one call declines, and the
    search answers through the forced kernel as the C++ one does; the kept list count of a
    plain query is worked out again after a change of the index's lists."""
    from retrieval.index.scan import KERNEL_ENV, search_ids_cpu

    index = build_ivf(catalog["x"], IVFConfig(nlist=64, nprobe=4, rerank=0))
    q = catalog["q"][:2]
    want = index.search(q, 20)
    assert index.lane_lists  # the lane kept its list count
    centroids_t, half, codes, scales, offsets, sig = index.kernel_tensors()
    fmask, fneg = torch.zeros(2, 0, sig.shape[1], dtype=torch.int64), torch.zeros(2, 0).bool()
    args = (q, centroids_t, half, 4, codes, scales, offsets, sig, fmask, fneg)
    order = (torch.zeros(2, 0, dtype=torch.int64), index.id_order.item_ids, index.id_order.perm)
    assert search_ids_cpu(*args, *order, 20) is not None
    monkeypatch.setenv(KERNEL_ENV, "reference")
    assert search_ids_cpu(*args, *order, 20) is None
    got = index.search(q, 20)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    index._refresh()
    assert not index.lane_lists


def test_rows_left_short_widen_as_the_general_path_does(monkeypatch) -> None:
    """Lists of very uneven sizes: rows whose lists hold fewer than k items take the planned
    path's next round (WIDEN x the lists) inside the plain search, with its answer, and are not
    planned again; rows still short (k above the catalog) take the planned path's later rounds,
    as before."""
    g = torch.Generator().manual_seed(5)
    sizes = [600, 300, 100, 40, 20, 10, 5, 3, 2, 1] * 4  # 40 clusters, 4,124 items
    centres = torch.randn(len(sizes), 16, generator=g) * 4
    x = torch.cat(
        [c + torch.randn(n, 16, generator=g) for c, n in zip(centres, sizes, strict=True)]
    )
    index = build_ivf(x, IVFConfig(nlist=40, nprobe=1))
    q = centres + 0.1 * torch.randn(len(sizes), 16, generator=g)
    planned: list[int] = []
    monkeypatch.setattr(
        index, "planned_positions",
        lambda *a, **k: planned.append(len(a[0])) or IVFIndex.planned_positions(index, *a, **k),
    )  # fmt: skip
    for k in (60, 5000):
        got = plain_search(index, q, k, None, 1, 0)
        want = IVFIndex.planned_positions(index, q, k, index.compile_filter(None, len(q)), 1, 0)
        assert got is not None and torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        if k == 60:
            held = index.offsets.diff()[index.probe(q, lists_for(index, 1.0, 1, k))[1]].sum(1)
            assert bool((held < k).any()) and planned == []  # short rows, widened in place
    assert planned == [len(q)]  # more than the catalog: every row, through the planned rounds
