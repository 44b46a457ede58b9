"""A plan's first round in one C++ call (``cpu_backend.lists_ids``, a shard's candidates)
answers exactly what the step-by-step path (exclusions mapped, probe, scan, rows -> ids)
answers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf, cpu_backend
from retrieval.index.candidates import candidates
from retrieval.index.plan import SearchPlan, kinds
from retrieval.index.probe import FEW_QUERIES
from retrieval.index.search import Candidates

FILTERS = [None, "shard in {0,1,2,3} and bucket != 5", "not shard in {0,1,2}"]


@pytest.fixture(scope="module", params=["ip", "l2"])
def index(request, catalog) -> IVFIndex:
    cfg = IVFConfig(nlist=64, nprobe=8, codes="int8", rerank=0, probe=request.param)
    return build_ivf(
        catalog["x"], cfg, item_attributes=catalog["attrs"], attribute_values=catalog["values"]
    )


def step_by_step(index: IVFIndex, q, fb, plan) -> Candidates:
    c = candidates(index.tensors(), q, fb, plan)  # positions
    ids = torch.where(c.keys >= 0, index.item_ids[c.keys.clamp(min=0)], c.keys)
    return Candidates(ids, c.approx, c.scores)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    b=st.integers(1, FEW_QUERIES),
    nprobe=st.integers(1, 70),
    r=st.sampled_from([1, 10, 100, 2_000, 25_000]),
    text=st.sampled_from(FILTERS),
    seen=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_one_call_equals_the_steps(index, catalog, b, nprobe, r, text, seen, seed):
    g = torch.Generator().manual_seed(seed)
    q = catalog["q"][torch.randint(0, len(catalog["q"]), (b,), generator=g)]
    fb = index.compile_filter(text, b)
    if seen:  # held ids, ids no index holds, and -1 pads
        ex = torch.randint(-1, index.ntotal + 50, (b, seen), generator=g)
        fb = FilterBatch(fb.masks, fb.negate, ex)
    p = min(nprobe, index.nlist)
    plan = SearchPlan(r, r, torch.full((b,), p), kinds(torch.zeros(b, dtype=torch.bool)), None)
    found = cpu_backend.lists_ids(index.tensors(), q, fb, plan, whole=False)
    assert found is not None  # the one call applies to this plan
    fast = Candidates(found[0], found[1], found[1])
    want = step_by_step(index, q, fb, plan)
    assert torch.equal(fast.keys, want.keys)
    assert torch.equal(fast.approx, want.approx) and torch.equal(fast.scores, want.scores)
    for row in range(b if seen else 0):  # a row's own seen items never come back
        assert not torch.isin(fast.keys[row], fb.exclude[row][fb.exclude[row] >= 0]).any()


def test_item_candidates_takes_the_one_call_only_where_it_applies(index, catalog, monkeypatch):
    calls = []
    real = cpu_backend.search_ids_cpu
    monkeypatch.setattr(
        cpu_backend, "search_ids_cpu", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q, b = catalog["q"][:3], 3
    fb = index.compile_filter(None, b)
    plain = SearchPlan(10, 10, torch.full((b,), 8), kinds(torch.zeros(b, dtype=torch.bool)), None)
    index.item_candidates(q, fb, plain)
    assert len(calls) == 1
    for other in (
        SearchPlan(10, 10, torch.tensor([8, 8, 4]), kinds(torch.zeros(b, dtype=torch.bool)), None),
        SearchPlan(10, 10, torch.full((b,), 8), kinds(torch.tensor([False, True, False])), None),
        SearchPlan(
            10,
            10,
            torch.full((b,), 2),
            kinds(torch.zeros(b, dtype=torch.bool)),
            torch.tensor([[0, 1], [2, 3], [4, -1]]),
        ),
    ):
        got = index.item_candidates(q, fb, other)
        assert len(calls) == 1  # per-row list counts, an exact row, a second round's lists
        want = step_by_step(index, q, fb, other)
        assert torch.equal(got.keys, want.keys)
    big = FEW_QUERIES + 1
    flat = SearchPlan(
        10, 10, torch.full((big,), 8), kinds(torch.zeros(big, dtype=torch.bool)), None
    )
    index.item_candidates(catalog["q"][:big], index.compile_filter(None, big), flat)
    assert len(calls) == 1  # a batch that large probes with one matmul
