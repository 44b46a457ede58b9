"""The filtered plan's bound check (retrieval/index/bound.py, issue 19) on data whose filters are
anti-correlated with the queries: recall at every selectivity, the provable bound missing
nothing, the statistics staying bounds after live updates, and routed answers equal to local."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.data.anticorrelated import SELECTIVITIES, AntiCorrelated, anticorrelated
from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.bound import _list_bounds, _may_hold
from retrieval.index.candidates import candidates
from retrieval.index.codes import dequantize
from retrieval.index.exact import recall_at_k
from retrieval.index.plan import BoundCheck, SearchPlan, kinds
from retrieval.index.scan import list_bounds_cpu, second_round_cpu
from retrieval.index.search import Candidates, run_search
from retrieval.index.split import shard_of, split_index
from retrieval.index.stats import IndexStats
from retrieval.index.update import add_items, remove_items
from support.anticorrelated_truth import filtered_truth
from support.formats import unversioned
from support.topk_check import assert_same_topk

K = 100


@pytest.fixture(scope="module")
def data() -> AntiCorrelated:
    return anticorrelated(20_000, 32, 200, n_centres=200, homes=20, neighbourhood=0.05, seed=0)


@pytest.fixture(scope="module")
def index(data) -> IVFIndex:
    cfg = IVFConfig(nlist=128, nprobe=8)
    return build_ivf(
        data.x, cfg, item_attributes=data.attributes, attribute_values=data.attribute_values
    )


def truth(data: AntiCorrelated, index: IVFIndex, selectivity: float) -> torch.Tensor:
    return filtered_truth(data, selectivity, K)


def recall(data: AntiCorrelated, index: IVFIndex, selectivity: float) -> float:
    ids, _ = index.search(data.q, K, data.filters(selectivity))
    return recall_at_k(ids, truth(data, index, selectivity))


@pytest.mark.parametrize("selectivity", SELECTIVITIES)
def test_filtered_recall_holds_at_every_selectivity(data, index, selectivity):
    assert 0.0 < index.stats.filter_bound_slack < 1.0  # measured at build
    assert recall(data, index, selectivity) >= 0.95


def test_the_first_round_alone_misses_on_this_data(data, index):
    """Without the check (filter_bound = 0) the plan's lists hold K eligible items that are not
    the best: the data is the case the check is for."""
    off = with_config(index, filter_bound=0.0, **UNMEASURED)
    assert min(recall(data, off, s) for s in (0.5, 0.2)) < 0.9


UNMEASURED = {"plan_costs": ()}
"""Settings that drop the build's measured plan costs: ``exact_cost`` and ``nprobe`` decide."""


def with_config(index: IVFIndex, **changes) -> IVFIndex:
    """A copy of ``index`` searched with other settings."""
    out = IVFIndex(index.config, index.dim, index.schema.attribute_values)
    out.load_state_dict(index.state_dict())
    measured = {k: changes.pop(k) for k in list(changes) if k in IndexStats.model_fields}
    out.config = index.config.model_copy(update=changes)
    out.stats = index.stats.model_copy(update=measured)
    return out


def provable(index: IVFIndex) -> IVFIndex:
    """``index`` with slack 1 (the proof) that never trades lists for an exact scan, so its
    answers are comparable, score for score, with a scan of every list."""
    return with_config(index, filter_bound_slack=1.0, exact_cost=1e9, **UNMEASURED)


def misses_nothing(index: IVFIndex, q: np.ndarray, texts: list[str]) -> torch.Tensor:
    """Asserts that ``index.search`` equals a scan of every list (the top-K approximate scores no
    probe rule can beat) on each row its first round did not leave short (those are scanned
    exactly, with decoded vectors' float scores) -> the search's ids ``[B, K]``."""
    b, qt = len(texts), torch.from_numpy(q)
    fb = index.compile_filter(texts, b)
    ids, scores = index.search(qt, K, fb)
    plan = SearchPlan(K, K, torch.full((b,), index.nlist), kinds(torch.zeros(b, dtype=torch.bool)))
    want = candidates(index.tensors(), qt, fb, plan)
    first = candidates(index.tensors(), qt, fb, index.plan(fb, index.params(K, rerank=0)))
    rows = first.keys[:, -1] >= 0
    assert int(rows.sum()) > b // 2
    assert_same_topk(ids[rows], scores[rows], index.item_ids[want.keys[rows]], want.scores[rows])
    return ids


@pytest.mark.parametrize("selectivity", [0.5, 0.2, 0.1])
def test_the_provable_bound_misses_nothing(data, index, selectivity):
    misses_nothing(provable(index), data.q, data.filters(selectivity))


def bounds_hold(index: IVFIndex) -> None:
    """Every item's residual (as decoded) is within its list's radius, and its signature within
    its list's bits."""
    lists = torch.repeat_interleave(torch.arange(index.nlist), index.offsets.diff())
    norms = dequantize(index.codes, index.scales).norm(dim=1)
    assert bool((norms <= index.list_radius[lists] + 1e-4).all())
    assert torch.equal(index.sig & index.list_bits[lists], index.sig)


def test_the_bounds_stay_bounds_after_live_updates(data, index):
    """Items far out of their lists (residuals 4x the largest) join; the radius grows, removing
    them does not shrink it, and the provable search still misses nothing."""
    bounds_hold(index)
    home = int(data.home[0])
    far = data.eligible_clusters(home, 0.2)[:20]
    gen = torch.Generator().manual_seed(5)
    centres = torch.from_numpy(data.centres[far])
    step = torch.randn(20, index.dim, generator=gen)
    step = step / step.norm(dim=1, keepdim=True) * 4 * float(index.list_radius.max())
    vectors = centres + step
    sig = index.schema.signatures({"cluster": far}, 20)
    ids = torch.arange(100_000, 100_020)
    grown = add_items(index, ids, vectors, sig)
    bounds_hold(grown)
    assert float(grown.list_radius.max()) > 3 * float(index.list_radius.max())
    found = misses_nothing(provable(grown), data.q, data.filters(0.2))
    assert bool(torch.isin(ids, found).any())  # some new item is among the best
    shrunk = remove_items(grown, ids)
    assert torch.equal(shrunk.list_radius, grown.list_radius)
    assert torch.equal(shrunk.list_bits, grown.list_bits)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_routed_answers_equal_local_ones(data, index, num_shards):
    """A router plans with the statistics only and asks its shards for the second round's lists
    (with the plan costs the build measured, and without them: lists then at 50 %)."""
    for measured in (True, False):
        routed_equal_local(
            data, index if measured else with_config(index, **UNMEASURED), num_shards, measured
        )


def routed_equal_local(
    data: AntiCorrelated, index: IVFIndex, num_shards: int, measured: bool
) -> None:
    stats, shards = split_index(index, shard_of(index.item_ids, num_shards), num_shards)
    q = torch.from_numpy(data.q[:40])
    for s in (0.5, 0.2, 0.01):
        texts = data.filters(s)[:40]
        fb = stats.compile_filter(texts, len(texts))
        plan = stats.plan(fb, stats.params(K), q=q)
        assert plan.check is not None or bool(plan.exact.all())  # 1 %: every row exact
        asked: list[SearchPlan] = []

        def fetch(p: SearchPlan, rows, q=q, fb=fb, asked=asked):
            asked.append(p)
            f = fb if rows is None else FilterBatch(fb.masks[rows], fb.negate[rows])
            qq = q if rows is None else q[rows]
            return Candidates.concat([sh.item_candidates(qq, f, p) for sh in shards])

        top = run_search(plan, fetch)
        want_ids, want_scores = index.search(q, K, texts)
        assert_same_topk(top.keys, top.scores, want_ids, want_scores)
        if s == 0.5 and not measured:  # the first round's lists, then a second round's
            assert asked[0].lists is not None and len(asked) > 1 and asked[1].lists is not None


def test_an_index_saved_before_the_bounds_loads_without_the_check(data, index):
    state = {k: v for k, v in unversioned(index.state_dict()).items() if not k.startswith("list_")}
    extra = dict(state["_extra_state"])
    extra["config"] = {
        k: v for k, v in extra["config"].items() if k not in ("filter_bound", "filter_bound_slack")
    }
    state["_extra_state"] = extra
    old = IVFIndex(IVFConfig(), index.dim)
    old.load_state_dict(state)
    assert old.list_radius.numel() == 0 and old.stats.filter_bound_slack == 0
    texts = data.filters(0.5)
    fb = old.compile_filter(texts, len(texts))
    assert old.plan(fb, old.params(K, 8, 0), q=torch.from_numpy(data.q)).check is None
    want = with_config(index, filter_bound=0.0).search(data.q, K, texts)
    assert torch.equal(old.search(data.q, K, texts)[0], want[0])


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 12),
    nlist=st.integers(1, 300),
    l2=st.booleans(),
    seed=st.integers(0, 999),
)
def test_the_cpu_bound_kernels_equal_their_torch_ops(b, nlist, l2, seed):
    """``list_bounds_cpu`` and ``second_round_cpu`` (one C++ pass a row) give exactly what the
    torch ops a GPU runs give: first lists, bounds, and the second round's rows and lists."""
    g = torch.Generator().manual_seed(seed)
    cfg = IVFConfig(nlist=nlist, probe="l2" if l2 else "ip")
    index = IVFIndex(cfg, 4)
    index.centroids = torch.zeros(nlist, 4)
    index.half_norms = torch.rand(nlist, generator=g)
    index.list_radius = torch.rand(nlist, generator=g)
    ip = torch.randn(b, nlist, generator=g)
    ip[:, ::7] = ip[:, :1].clone()  # equal keys in a row
    index.list_bits = torch.randint(0, 16, (nlist, 2), generator=g)
    masks = torch.randint(0, 16, (b, 3, 2), generator=g)
    masks[1::2] = masks[:1].clone()  # rows sharing a filter
    negate = torch.rand(b, 3, generator=g) < 0.3
    sizes = torch.randint(0, 4, (nlist,), generator=g)
    nprobe = torch.randint(1, nlist + 1, (b,), generator=g)
    factor = torch.rand(b, generator=g) * 2
    mine = torch.rand(b, generator=g) < 0.8
    p = int(nprobe.max())
    half = index.half_norms if l2 else None
    first, bounds = list_bounds_cpu(
        ip, half, index.list_bits, masks, negate, sizes, nprobe, factor, index.list_radius, mine, p
    )
    reach = torch.ones(b, nlist, dtype=torch.bool)
    if bool(mine.any()):
        reach[mine] = _may_hold(index.tensors(), masks[mine], negate[mine])
    want_first, want_bounds = _list_bounds(
        index.tensors(), ip, reach & (sizes > 0), nprobe, factor, mine, p
    )
    assert torch.equal(first, want_first)
    assert torch.equal(bounds, want_bounds)
    check = BoundCheck(bounds, sizes, torch.rand(b, generator=g) * 8)
    kth = torch.randn(b, generator=g)
    kth[0] = float("-inf")  # a row short of k: every list it can reach is needed
    got = second_round_cpu(bounds, kth, sizes, check.budget)
    want = check.second_round_torch(kth)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)
