"""The filtered plan's cost model (``retrieval/index/costs.py``) and the build's measurement of
it (``calibrate.py``): the model's arithmetic, what the build records, and that the planner
picks the plan the recorded costs say is cheaper. Which plan is faster on a machine is measured
in ``bench/ann.py``, never timed here."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch

from retrieval.filters import estimate_selectivity
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.calibrate import BATCH, SELECTIVITIES
from retrieval.index.costs import exact_codes, exact_cost, lists_to_hold

COSTS = ((1.0, 0.5, 2.0), (1.0, 0.05, 8.0), (32.0, 0.5, 4.0), (32.0, 0.05, 16.0))


def test_exact_cost_reads_the_batch_regime_and_interpolates_in_log_selectivity():
    sel = torch.tensor([0.5, 0.05, 0.5**0.5 * 0.05**0.5, 0.9, 0.001])
    one = exact_cost(COSTS, 99.0, sel, 1)
    torch.testing.assert_close(one, torch.tensor([2.0, 8.0, 5.0, 2.0, 8.0], dtype=torch.float64))
    many = exact_cost(COSTS, 99.0, sel, 64)
    torch.testing.assert_close(
        many, torch.tensor([4.0, 16.0, 10.0, 4.0, 16.0], dtype=torch.float64)
    )
    assert bool((exact_cost((), 3.0, sel, 1) == 3.0).all())  # unmeasured: the constant


def test_exact_codes_use_the_constant_off_the_measured_device():
    cfg = IVFConfig(plan_costs=COSTS, exact_cost=1.0)
    sel = torch.tensor([0.05])
    assert float(exact_codes(cfg, 1000, sel, 1)[0]) == pytest.approx(0.05 * 1000 * 8.0)
    assert float(exact_codes(cfg, 1000, sel, 1, measured=False)[0]) == pytest.approx(50.0)


def test_lists_to_hold_reads_the_coverage_curve():
    curve = ((100, 10.0), (400, 30.0), (1600, 60.0))
    assert lists_to_hold(curve, 50, 256) == 10.0
    assert lists_to_hold(curve, 200, 256) == pytest.approx(20.0)  # halfway in log m
    assert lists_to_hold(curve, 1600, 256) == 60.0
    assert lists_to_hold(curve, 1601, 256) == 256.0  # past the curve: every list
    assert lists_to_hold((), 10_000, 256) == 0.0


@pytest.fixture(scope="module")
def index(catalog) -> IVFIndex:
    return build_ivf(
        catalog["x"],
        IVFConfig(nlist=64, nprobe=4),
        item_attributes=catalog["attrs"],
        attribute_values=catalog["values"],
    )


def test_the_build_measures_costs_and_coverage(index):
    cfg = index.config
    assert sorted({(b, s) for b, s, _ in cfg.plan_costs}) == sorted(
        (float(b), s) for b in (1, BATCH) for s in SELECTIVITIES
    )
    assert all(r > 0 for _, _, r in cfg.plan_costs)
    ms = [m for m, _ in cfg.coverage_curve]
    lists = [n for _, n in cfg.coverage_curve]
    assert ms == sorted(ms) and ms[0] == cfg.tune_k
    assert lists == sorted(lists) and lists[0] >= 1 and lists[-1] <= index.nlist


def test_costs_survive_save_and_load(index):
    buf = io.BytesIO()
    torch.save(index.state_dict(), buf)
    buf.seek(0)
    loaded = IVFIndex(IVFConfig(nlist=64), index.dim, index.schema.attribute_values)
    loaded.load_state_dict(torch.load(buf, weights_only=False))
    assert loaded.config.plan_costs == index.config.plan_costs
    assert loaded.config.coverage_curve == index.config.coverage_curve


def test_nothing_is_measured_without_attributes_or_when_told_not_to(catalog):
    plain = build_ivf(catalog["x"][:3000], IVFConfig(nlist=16))
    assert plain.config.plan_costs == () and plain.config.coverage_curve == ()
    off = build_ivf(
        catalog["x"][:3000],
        IVFConfig(nlist=16, measure_costs=False),
        item_attributes={k: v[:3000] for k, v in catalog["attrs"].items()},
        attribute_values=catalog["values"],
    )
    assert off.config.plan_costs == () and off.config.coverage_curve == ()


@pytest.mark.parametrize("ratio", [0.5, 4.0, 40.0])
def test_the_plan_takes_the_cheaper_plan_by_the_recorded_costs(index, ratio):
    """``shard in 0..3``: ~12.5 % of the catalog. Exact costs sel * N * ratio codes; lists
    cost the more of nprobe and the coverage curve's lists, times the items per list."""
    costs = tuple((b, s, ratio) for b, s, _ in index.config.plan_costs)
    curve = ((100, 8.0), (800, 24.0), (6400, 48.0))
    idx = IVFIndex(index.config, index.dim, index.schema.attribute_values)
    idx.load_state_dict(index.state_dict())
    idx.config = replace(index.config, plan_costs=costs, coverage_curve=curve)
    fb = idx.compile_filter("shard in {0, 1, 2, 3}", 1)
    plan = idx.plan(fb, 100, 4, 0)
    sel = float(estimate_selectivity(fb, idx.bit_counts, idx.ntotal)[0])  # ~1/8
    lists = max(float(plan.nprobe[0]), lists_to_hold(curve, 100 / sel, idx.nlist))
    cheaper_exact = sel * idx.ntotal * ratio <= lists * idx.ntotal / idx.nlist
    assert bool(plan.exact[0]) == cheaper_exact
    assert cheaper_exact == (ratio < 3.0)  # 24 of 64 lists against N / 8 x ratio: both answers
