"""The device path (``executor.backend = "device"``: the plan decided on the device, every round
in fixed shapes) answers what the host-planned rounds answer, id for id (ties within float
rounding aside), on an index priced without measured costs as a GPU prices it; and it runs
under the device discipline (nothing read back, no shape from data) for each batch bucket, with
and without filters and excluded items."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from common.device_discipline import DeviceDiscipline
from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.cuda_graphs import _CACHES
from retrieval.index.device_plan import cheaper_exact, first_width, row_lists
from retrieval.index.executor import BACKEND_ENV, Executor
from retrieval.index.plan import RowKind
from support.topk_check import assert_same_topk
from tests.conftest import clustered

N, D = 3000, 16
FILTERS = [
    None,
    "shard = 3",  # narrow: exact rows
    "bucket = 1",  # wide: lists with the bound check
    "shard in {1, 2, 3} and not bucket = 0",
    "shard = 3 and bucket = 2",  # fewer items than a large k
    "shard != 3 or bucket = 1",  # a clause with a "none of these bits" part: wide
    "shard in {1, 2} and (shard != 1 or bucket = 2)",  # and narrow
]


@pytest.fixture(scope="module")
def data() -> dict:
    x = clustered(N, D, 30, seed=0)
    g = torch.Generator().manual_seed(7)
    q = x[torch.randint(0, N, (16,), generator=g)] + 0.3 * torch.randn(16, D, generator=g)
    rng = np.random.default_rng(1)
    attrs = {"shard": rng.integers(0, 32, N), "bucket": rng.integers(0, 4, N)}
    values = {"shard": [str(i) for i in range(32)], "bucket": [str(i) for i in range(4)]}
    return {"x": x, "q": q, "attrs": attrs, "values": values}


@pytest.fixture(scope="module", params=[("int8", "ip", "none"), ("fp8", "l2", "float32")])
def index(request, data) -> IVFIndex:
    codes, probe, copy = request.param
    cfg = IVFConfig(
        nlist=24, nprobe=4, codes=codes, probe=probe, exact_copy=copy, measure_costs=False
    )
    return build_ivf(data["x"], cfg, item_attributes=data["attrs"], attribute_values=data["values"])


def batch_filter(index: IVFIndex, q: torch.Tensor, f: str | None, seen: bool) -> FilterBatch:
    b = q.shape[0]
    fb = index.compile_filter(f, b)
    if not seen:
        return fb
    index.executor.backend = "auto"
    ids = index.search(q, 30)[0]  # each row's own best, some cut short
    ids[0, 10:] = -1
    return FilterBatch(fb.masks, fb.negate, ids, fb.neg_masks)


def both(index: IVFIndex, q: torch.Tensor, k: int, fb: FilterBatch, **kw):
    index.executor.backend = "auto"
    want = index.search(q, k, fb, **kw)
    index.executor.backend = "device"
    try:
        return index.search(q, k, fb, **kw), want
    finally:
        index.executor.backend = "auto"


@pytest.mark.parametrize("f", FILTERS)
@pytest.mark.parametrize("seen", [False, True])
def test_answers_as_the_host_planned_rounds(index: IVFIndex, data, f, seen) -> None:
    for b, k in ((1, 5), (5, 40), (16, 12)):
        q = data["q"][:b]
        fb = batch_filter(index, q, f, seen)
        got, want = both(index, q, k, fb)
        assert_same_topk(*got, *want)


def test_the_cases_cover_each_decision(index: IVFIndex, data) -> None:
    """The filters above take each of the planner's ways: plain rows, exact rows, list rows
    with the bound check (its second round)."""
    q = data["q"]
    kinds = set()
    for f in FILTERS:
        plan = index.plan(index.compile_filter(f, len(q)), index.params(40), q)
        kinds |= set(plan.kind.tolist())
        if f == "bucket = 1":
            assert plan.check is not None
    assert {int(RowKind.PLAIN), int(RowKind.LISTS)} <= kinds
    assert kinds & {int(RowKind.EXACT), int(RowKind.SHARED_EXACT)}


def test_a_mixed_batch_exact_everything_and_a_rerank(index: IVFIndex, data) -> None:
    q = data["q"][:8]
    mixed = ["shard = 3", None, "bucket = 1", "shard = 3 and bucket = 2"] * 2
    fb = index.compile_filter(mixed, 8)
    runs = [both(index, q, 20, fb), both(index, q, 20, fb, exact=True)]
    if index.keeps_exact_copy:
        runs.append(both(index, q, 10, fb, rerank=40))
    for got, want in runs:
        assert_same_topk(*got, *want)


@pytest.mark.parametrize("b", [1, 2, 4, 8])
def test_each_bucket_runs_under_the_device_discipline(index: IVFIndex, data, b: int) -> None:
    q = data["q"][:b]
    for f, seen in ((None, False), ("bucket = 1", True), ("shard = 3", False)):
        fb = batch_filter(index, q, f, seen)
        index.executor.backend = "device"
        try:
            with DeviceDiscipline():
                ids, scores = index.execute(q, fb, index.params(10))
        finally:
            index.executor.backend = "auto"
        assert ids.shape == scores.shape == (b, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 16])
def test_on_a_gpu_the_graphed_device_path_answers_as_the_cpu(index: IVFIndex, data, b) -> None:
    """On a GPU the device path (the Triton scan, the plan decided on the device) is recorded as
    one CUDA graph per bucket and shapes, and answers as the CPU's host-planned rounds, with and
    without a filter and seen items (float sums in another order on a GPU: near-ties swap)."""
    gpu = copy.deepcopy(index).to("cuda")
    gpu.executor.backend = "device"
    q = data["q"][:b]
    for f, seen in ((None, False), ("bucket = 1", True), ("shard = 3", False)):
        fb = batch_filter(index, q, f, seen)
        want = index.search(q, 10, fb)[0]
        for _ in range(2):  # the capture, then a replay
            got = gpu.search(q.cuda(), 10, fb.to("cuda"))[0].cpu()
            assert (got == want).float().mean() >= 0.99
    graphs = _CACHES[gpu.executor].values()
    assert len(graphs) == 3 and all(g.graph is not None for g in graphs)


@pytest.mark.parametrize(("r", "excluded"), [(5, 0), (40, 30), (400, 0)])
def test_the_first_rounds_width_bounds_every_list_row(index: IVFIndex, r, excluded) -> None:
    """Over selectivities from one in a million to all, no row that takes lists (not exact by
    ``cheaper_exact``) probes more lists than the filtered first round's width."""
    t = index.tensors()
    sel = torch.logspace(-6, 0, 4000)
    need = torch.full_like(sel, r + excluded, dtype=torch.int64)
    lists = row_lists(t, sel, 4, need)
    listed = ~cheaper_exact(t, sel, lists)
    width = first_width(t, r, 4, 1, excluded)
    assert int(lists[listed].max()) <= width <= t.nlist
    assert width < t.nlist or r == 400  # narrower than every list where that holds


def test_the_backend_from_the_environment_and_a_targets_search(index, data, monkeypatch) -> None:
    """``$RECSERVE_INDEX_BACKEND`` picks new executors' backend; on the device backend a search
    with recall targets (planned on the host) takes the host path and answers as it does."""
    monkeypatch.setenv(BACKEND_ENV, "device")
    assert Executor().backend == "device"
    monkeypatch.delenv(BACKEND_ENV)
    assert Executor().backend == "auto"
    q = data["q"][:4]
    fb = index.compile_filter("bucket = 1", 4)
    got, want = both(index, q, 10, fb, recall_target=1.0)  # 1: exact, with no curve
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
