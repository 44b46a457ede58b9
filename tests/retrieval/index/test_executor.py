"""The executor runs every plan kind with the planned rounds' answer, id for id, whichever
backend takes it (one C++ call keyed by id, the CUDA graph of a plain first round, the rounds):
``PLAIN`` rows (no filter clause, no target), ``LISTS`` rows, ``SHARED_EXACT`` batches and
``EXACT`` rows; exact kinds answer the exact reference itself, and a catalog too small for its
lists is searched exactly."""

from __future__ import annotations

import pytest
import torch

from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf, cpu_backend
from retrieval.index.exact import exact_search, recall_at_k
from retrieval.index.plan import RowKind
from retrieval.index.planner import SMALL_CATALOG_FILL, lists_for, make_plan
from retrieval.index.probe import FEW_QUERIES, probe_lists
from retrieval.index.scan import scan
from retrieval.index.tensors import ScanRows
from support.plan_costs import with_costs
from tests.retrieval.index.reference import kept_plan, planned, planned_ids


@pytest.fixture(scope="module", params=[("int8", "ip"), ("int8", "l2"), ("fp8", "ip")])
def index(request, catalog) -> IVFIndex:
    codes, probe = request.param
    cfg = IVFConfig(nlist=128, nprobe=8, codes=codes, probe=probe)
    return build_ivf(
        catalog["x"], cfg, item_attributes=catalog["attrs"], attribute_values=catalog["values"]
    )


def same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("k", [1, 10, 100])
def test_a_plain_plan_answers_as_the_rounds(index: IVFIndex, catalog, k: int) -> None:
    q = catalog["q"]
    assert bool((kept_plan(index, q, k, None, 8).kind == RowKind.PLAIN).all())
    for fb in (index.compile_filter(None, len(q)), None):
        same(index.search(q, k, fb, nprobe=8, positions=True), planned(index, q, k, fb, 8))
        same(index.search(q[:1], k, fb and fb.rows(torch.tensor([0]))), planned_ids(
            index, q[:1], k, None, 8
        ))  # fmt: skip


def test_excluded_items_and_a_large_k(index: IVFIndex, catalog) -> None:
    q = catalog["q"][:8]
    seen = index.search(q, 30)[0]  # each row's own best 30
    empty = index.compile_filter(None, len(q))
    fb = FilterBatch(empty.masks, empty.negate, exclude=seen)
    got = index.search(q, 20, fb, positions=True)
    same(got, planned(index, q, 20, fb, 8))
    assert not bool(torch.isin(index.item_ids[got[0]], seen).any())
    uneven = seen.clone()  # rows with different counts of seen items
    uneven[0, 5:] = -1
    fb_uneven = FilterBatch(fb.masks, fb.negate, uneven)
    got = index.search(q, 20, fb_uneven, positions=True)
    same(got, planned(index, q, 20, fb_uneven, 8))
    assert not bool(torch.isin(index.item_ids[got[0][1:]], seen[1:]).any())
    # a large k: the plan widens the lists to hold it; rows the lists leave short take the
    # later rounds
    q = catalog["q"]
    coarse, lists = index.probe(q, 2)
    sizes = index.offsets.diff()[lists].sum(1)  # [B] items in each row's 2 lists
    short = int(sizes.min()) + 1  # more than some row's 2 lists hold
    empty = index.compile_filter(None, len(q))
    rows = ScanRows(q.contiguous(), lists, coarse, empty.masks, empty.negate)
    first, _ = scan(index.tensors().lists, rows, short)
    assert bool((first[:, -1] < 0).any())
    for k in (short, 2000):
        got = index.search(q, k, nprobe=1, positions=True)
        assert bool((got[0] >= 0).all())
        same(got, planned(index, q, k, None, 1))


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
def test_a_few_queries_search_in_one_call_as_the_rounds(index, catalog, monkeypatch, k):
    """``search`` on a few CPU queries: one C++ call keyed by id for int8 codes, the rounds'
    ids and scores; rows its lists leave short (k = 2000 at nprobe 1) and fp8 codes go on to
    the rounds, with the same answer."""
    calls: list[int] = []
    real = cpu_backend.search_ids_cpu
    monkeypatch.setattr(
        cpu_backend, "search_ids_cpu", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q = catalog["q"][:FEW_QUERIES]
    seen = index.search(q, 5)[0]
    empty = index.compile_filter(None, len(q))
    for fb in (None, FilterBatch(empty.masks, empty.negate, exclude=seen)):
        calls.clear()
        same(index.search(q, k, fb, nprobe=1), planned_ids(index, q, k, fb, 1))
        assert len(calls) == 1  # int8 answers in the call; fp8 and short rows go on after it


def test_a_forced_kernel_leaves_the_one_call_to_the_rounds(catalog, monkeypatch):
    """$RECSERVE_SCAN_KERNEL set (read by the C++ call itself): the one call declines, and the
    search answers through the forced kernel as the C++ one does."""
    from retrieval.index.scan import KERNEL_ENV

    index = build_ivf(catalog["x"], IVFConfig(nlist=64, nprobe=4, rerank=0))
    q = catalog["q"][:2]
    want = index.search(q, 20)
    plan = kept_plan(index, q, 20, None, 4)
    assert cpu_backend.lists_ids(index.tensors(), q, None, plan, whole=True) is not None
    monkeypatch.setenv(KERNEL_ENV, "reference")
    assert cpu_backend.lists_ids(index.tensors(), q, None, plan, whole=True) is None
    got = index.search(q, 20)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_rows_left_short_widen_as_the_rounds_do() -> None:
    """Lists of very uneven sizes: rows whose lists hold fewer than k items widen (WIDEN x the
    lists), then scan exactly (k above what any lists hold), as the planned rounds do."""
    g = torch.Generator().manual_seed(5)
    sizes = [600, 300, 100, 40, 20, 10, 5, 3, 2, 1] * 4  # 40 clusters, 4,124 items
    centres = torch.randn(len(sizes), 16, generator=g) * 4
    x = torch.cat(
        [c + torch.randn(n, 16, generator=g) for c, n in zip(centres, sizes, strict=True)]
    )
    index = build_ivf(x, IVFConfig(nlist=40, nprobe=1))
    q = centres + 0.1 * torch.randn(len(sizes), 16, generator=g)
    for k in (60, 4000):
        same(index.search(q, k, nprobe=1, positions=True), planned(index, q, k, None, 1))
    held = index.offsets.diff()[index.probe(q, lists_for(index.tensors(), 1.0, 1, 60))[1]]
    assert bool((held.sum(1) < 60).any())  # some rows were short


@pytest.mark.parametrize("kind", list(RowKind))
def test_each_plan_kind_answers_as_the_rounds_and_exact_kinds_as_the_reference(
    index: IVFIndex, catalog, kind: RowKind
) -> None:
    """A batch of each kind through the executor (one call, graph or rounds) equals the planned
    rounds; the exact kinds equal the exact reference, brute force over the vectors the index
    holds, and the list kinds probing every list come close to it."""
    q = catalog["q"][:6]
    b, k = len(q), 20
    if kind == RowKind.LISTS:  # priced so that lists win, whatever the build measured
        index = with_costs(index, 1e-3, 1e-9)
    text = {
        RowKind.PLAIN: None,
        RowKind.LISTS: ["shard in {0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}", None] * 3,
        RowKind.SHARED_EXACT: "shard = 3",
        RowKind.EXACT: ["shard = 3", "shard = 4"] * 3,
    }[kind]
    fb = None if text is None else index.compile_filter(text, b)
    exact = kind in (RowKind.SHARED_EXACT, RowKind.EXACT)
    want = planned_ids(index, q, k, fb, 8) if not exact else None
    if exact:
        pos, scores = planned(index, q, k, fb, 8, exact=True)
        want = index.ids_at(pos), scores
        plan = index.executor.plans.plan(index.tensors(), fb, index.params(k, 8, exact=True), q)
        assert plan.kind.tolist() == [kind] * b
        got = index.search(q, k, text, nprobe=8, exact=True)
    else:
        assert kept_plan(index, q, k, fb, 8).kind.tolist()[0] == kind
        got = index.search(q, k, text, nprobe=8)
    same(got, want)
    every = index.vectors_at(torch.arange(index.ntotal))
    fb_all = index.compile_filter(None, b) if fb is None else fb
    truth = []
    for row in range(b):
        keep = torch.ones(index.ntotal, dtype=torch.bool)
        if fb_all.masks.shape[1]:
            from retrieval.filters import eligible

            keep = eligible(index.sig, fb_all.masks[row], fb_all.negate[row])
        truth.append(index.item_ids[exact_search(every, q[row : row + 1], k, keep)[0][0]])
    truth_ids = torch.stack(truth)
    if exact:
        assert torch.equal(got[0], truth_ids)
    else:
        full = index.search(q, k, text, nprobe=index.nlist)
        assert recall_at_k(full[0], truth_ids) >= 0.95


def test_a_tiny_catalog_is_searched_exactly(catalog) -> None:
    """80 items (2 lists by default): every row scans exactly, recall 1 against exact search,
    whatever nprobe asks (a list plan probing one of the two lists found 0.86 of the top 10)."""
    cfg = IVFConfig(nlist=2, nprobe=1)
    assert SMALL_CATALOG_FILL * cfg.tune_k >= 80
    x = catalog["x"][:80]
    index = build_ivf(x, cfg)
    q = catalog["q"][:16]
    plan = kept_plan(index, q, 10, None, 1)
    assert plan.kind.tolist() == [RowKind.SHARED_EXACT] * len(q)
    ids, _ = index.search(q, 10)
    truth = index.item_ids[exact_search(index.vectors_at(torch.arange(80)), q, 10)[0]]
    assert recall_at_k(ids, truth) == 1.0
    assert torch.equal(ids, index.search(q, 10, exact=True)[0])


def test_kept_plans_of_excluding_rows_follow_how_many_each_excludes(index, catalog) -> None:
    """A plain plan that excludes ids (a served user's history) is kept by how many ids each
    row excludes: the same counts share one plan, other counts get what make_plan makes."""
    q, t, params = catalog["q"][:1], index.tensors(), index.params(50, 2, 0)
    empty = index.compile_filter(None, 1)

    def excluding(n: int) -> FilterBatch:
        ids = torch.full((1, 600), -1, dtype=torch.int64)
        ids[0, :n] = torch.arange(n)
        return FilterBatch(empty.masks, empty.negate, ids)

    kept = index.executor.plans
    assert kept.plan(t, excluding(5), params, q) is kept.plan(t, excluding(5), params, q)
    plans = {}
    for n in (600, 5, 0, 300, 600):
        got, want = kept.plan(t, excluding(n), params, q), make_plan(t, excluding(n), params, q)
        assert torch.equal(got.nprobe, want.nprobe) and torch.equal(got.kind, want.kind)
        assert (got.hold is None) == (want.hold is None)
        assert got.hold is None or torch.equal(got.hold, want.hold)
        plans[n] = int(got.nprobe[0])
    assert plans[600] > plans[5]  # the counts change the plan: a key without them fails
