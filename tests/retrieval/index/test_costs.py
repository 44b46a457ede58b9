"""The filtered plan's cost model (``retrieval/index/costs.py``), the build's measurement of it
(``calibrate.py``) and the exact search it leads to (``plan.RowKind.SHARED_EXACT``, one C++ call in
``cpu_backend.py``): the model's arithmetic, what the build records, that the planner picks the
plan the recorded costs say is cheaper, and that the one-call exact search answers what the
planned rounds answer. Which plan is
faster on a machine is measured in ``bench/ann.py``, never timed here."""

from __future__ import annotations

import io
import math

import pytest
import torch

import retrieval.index.cpu_backend as cpu_backend
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.calibrate import BATCH, SELECTIVITIES
from retrieval.index.costs import exact_codes, plan_seconds
from retrieval.index.plan import RowKind
from retrieval.index.scan import bit_index_cpu
from retrieval.index.stats import IndexStats
from support.plan_costs import with_costs
from tests.retrieval.index.reference import kept_plan, planned_ids

# (batch, selectivity, exact s per item, list s per query, first-round lists, codes per query)
COSTS = (
    (1.0, 0.5, 1e-7, 1e-3, 10.0, 1000.0),
    (1.0, 0.02, 4e-7, 4e-3, 40.0, 8000.0),
    (32.0, 0.5, 1e-8, 1e-4, 10.0, 1000.0),
    (32.0, 0.02, 4e-8, 4e-4, 40.0, 8000.0),
)


def test_plan_seconds_read_the_regime_and_interpolate_in_log_log():
    cfg = IndexStats(plan_costs=COSTS)
    exact, lists = plan_seconds(cfg, 1_000_000, 0.5, 10, 1)
    assert exact == pytest.approx(0.5 * 1e6 * 1e-7) and lists == pytest.approx(1e-3)
    mid = math.sqrt(0.5 * 0.02)  # halfway in log: the geometric mean of the times
    exact, lists = plan_seconds(cfg, 1_000_000, mid, 1, 1)
    assert exact == pytest.approx(mid * 1e6 * 2e-7) and lists == pytest.approx(2e-3)
    _, batched = plan_seconds(cfg, 1_000_000, 0.5, 10, 64)
    assert batched == pytest.approx(1e-4)
    _, wider = plan_seconds(cfg, 1_000_000, 0.5, 30, 1)  # 3x the first round's lists
    assert wider == pytest.approx(3e-3)
    _, clamped = plan_seconds(cfg, 1_000_000, 0.001, 1, 1)
    assert clamped == pytest.approx(4e-3)
    assert plan_seconds(cfg, 1_000_000, 0.5, 10, 1, measured=False) is None
    assert plan_seconds(IndexStats(), 1_000_000, 0.5, 10, 1) is None


def test_exact_codes_price_the_exact_scan_in_list_codes():
    cfg, stats = IVFConfig(exact_cost=3.0), IndexStats(plan_costs=COSTS)
    per_code = 1e-3 / 1000.0
    assert exact_codes(cfg, stats, 1000, 0.5, 1) == pytest.approx(0.5 * 1000 * 1e-7 / per_code)
    assert exact_codes(cfg, stats, 1000, 0.5, 1, measured=False) == pytest.approx(0.5 * 1000 * 3.0)


@pytest.fixture(scope="module")
def index(catalog) -> IVFIndex:
    return build_ivf(
        catalog["x"],
        IVFConfig(nlist=64, nprobe=4),
        item_attributes=catalog["attrs"],
        attribute_values=catalog["values"],
    )


def test_the_build_measures_both_plans(index):
    rows = index.stats.plan_costs
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (float(b), s) for b in (1, BATCH) for s in SELECTIVITIES
    )
    assert all(len(r) == 6 and min(r[2:]) > 0 for r in rows)


def test_costs_survive_save_and_load(index):
    buf = io.BytesIO()
    torch.save(index.state_dict(), buf)
    buf.seek(0)
    loaded = IVFIndex(IVFConfig(nlist=64), index.dim, index.schema.attribute_values)
    loaded.load_state_dict(torch.load(buf, weights_only=False))
    assert loaded.stats.plan_costs == index.stats.plan_costs


def test_nothing_is_measured_without_attributes_or_when_told_not_to(catalog):
    plain = build_ivf(catalog["x"][:3000], IVFConfig(nlist=16))
    assert plain.stats.plan_costs == ()
    off = build_ivf(
        catalog["x"][:3000],
        IVFConfig(nlist=16, measure_costs=False),
        item_attributes={k: v[:3000] for k, v in catalog["attrs"].items()},
        attribute_values=catalog["values"],
    )
    assert off.stats.plan_costs == ()


@pytest.mark.parametrize("list_query_s", [1e-6, 1e-2])
def test_the_plan_takes_the_plan_the_recorded_costs_price_lower(index, list_query_s):
    """``shard in 0..3``: ~1/8 of 20k items, 2,500 x 1e-7 s = 0.25 ms exact; lists cost
    ``list_query_s`` times their first round over the recorded one."""
    idx = with_costs(index, 1e-7, list_query_s)
    plan = idx.search_plan(100, "shard in {0, 1, 2, 3}", nprobe=4)
    assert bool(plan.exact[0]) == (list_query_s > 1e-3)


def shared_exact(index: IVFIndex, q: torch.Tensor, fb) -> bool:
    """The executor's kept plan for ``q`` under ``fb`` (k 100, nprobe 4) is the shared exact scan."""
    plan = kept_plan(index, q, 100, fb, 4)
    return bool((plan.kind == RowKind.SHARED_EXACT).all())


@pytest.mark.parametrize("batch", [1, 3, 40])
@pytest.mark.parametrize("text", ["shard in {0, 1, 2, 3}", "shard = 0 and bucket in {0, 1}"])
def test_the_exact_search_answers_what_the_planned_path_does(index, catalog, batch, text):
    """One C++ call for a few queries, torch ops for more, the planned path's rounds: the same
    ids and scores (the second filter admits ~40 items, fewer than k: padded alike)."""
    idx = with_costs(index, 1e-9, 1.0)  # the exact scan, whatever the machine measured
    q = catalog["q"][:batch]
    fb = idx.compile_filter(text, batch)
    assert shared_exact(idx, q, fb)
    got = cpu_backend.shared_exact_ids(idx.tensors(), q, fb, kept_plan(idx, q, 100, fb, 4))
    assert got is not None
    want, scores = planned_ids(idx, q, 100, fb, 4)
    assert torch.equal(got[0], want)
    torch.testing.assert_close(got[1], scores, rtol=0, atol=0)
    ids, s = idx.search(q, 100, text, nprobe=4)
    assert torch.equal(ids, want) and torch.equal(s, scores)


def test_a_row_no_clause_narrows_answers_as_it_does_alone_beside_filtered_rows(index, catalog):
    """Even where the costs price the exact scan lower, an unfiltered row takes lists in a
    batch with filtered rows, as it does alone: its scores (the scan's int8 query) do not depend
    on what shares its batch (a served request's answer did, under a concurrent filtered one)."""
    idx = with_costs(index, 1e-12, 1.0)
    q = catalog["q"][:3]
    alone = idx.search(q[:1], 50)
    mixed = idx.search(q, 50, ["", "shard = 0", "shard in {1, 2}"])
    assert torch.equal(mixed[0][:1], alone[0]) and torch.equal(mixed[1][:1], alone[1])
    plan = idx.search_plan(50, ["", "shard = 0"])
    assert plan.exact.tolist() == [False, True]


def test_the_exact_search_leaves_lists_and_mixed_batches_to_the_planner(index, catalog):
    q = catalog["q"][:2]
    lists = with_costs(index, 1.0, 1e-9)
    assert not shared_exact(lists, q, lists.compile_filter("shard = 0", 2))
    exact = with_costs(index, 1e-9, 1.0)
    mixed = exact.compile_filter(["shard = 0", "shard = 1"], 2)
    plan = kept_plan(exact, q, 100, mixed, 4)
    assert plan.kind.tolist() == [RowKind.EXACT, RowKind.EXACT]  # each its own scan
    assert not shared_exact(exact, q, None)


def test_more_scores_than_one_call_holds_take_the_chunked_scan(index, catalog, monkeypatch):
    idx = with_costs(index, 1e-9, 1.0)
    q, fb = catalog["q"][:20], idx.compile_filter("shard in {0, 1, 2, 3}", 20)
    plan = kept_plan(idx, q, 100, fb, 4)
    one_call = cpu_backend.shared_exact_ids(idx.tensors(), q, fb, plan)
    monkeypatch.setattr(cpu_backend, "MAX_SCORES", 1)
    chunked = cpu_backend.shared_exact_ids(idx.tensors(), q, fb, plan)
    assert one_call is not None and chunked is not None
    assert torch.equal(one_call[0], chunked[0]) and torch.equal(one_call[1], chunked[1])


def test_a_kept_plan_choice_follows_the_costs_and_the_catalog(index, catalog):
    """The executor keeps its plan choice per filter; new statistics (the build's costs), or new
    signatures (the bit counts the selectivity is read from), decide again."""
    q = catalog["q"][:1]
    idx = with_costs(index, 1e-9, 1.0)
    fb = idx.compile_filter("shard = 0", 1)
    assert shared_exact(idx, q, fb)  # exact: kept
    idx.stats = with_costs(index, 1.0, 1e-9).stats
    assert not shared_exact(idx, q, fb)  # the new costs price lists lower
    idx.stats = with_costs(index, 1e-9, 1.0).stats
    assert shared_exact(idx, q, fb)
    everyone = torch.full_like(
        idx.sig, -1
    )  # every item now holds every value: shard = 0 passes all
    idx.bit_counts, idx.postings = bit_index_cpu(everyone)
    idx.sig = everyone
    idx.sample_filters()  # as an update's refresh does: the estimate's sample too
    assert not shared_exact(idx, q, fb)  # admits all: lists, as alone


def test_the_list_plan_is_timed_as_a_search_plans_it(index, catalog, monkeypatch):
    """The calibration's list plan reads the build's curves and bound slack (what a search's plan
    reads): timed without them it plans other rounds than a search runs, and prices lists wrong."""
    import retrieval.index.calibrate as calibrate

    assert index.stats.filter_bound_slack > 0 or index.stats.slack_curve  # something to keep
    seen: list[IndexStats] = []
    timed = calibrate._list_plan

    def spy(listed: IVFIndex, *args, **kwargs):
        seen.append(listed.stats)
        return timed(listed, *args, **kwargs)

    monkeypatch.setattr(calibrate, "_list_plan", spy)
    calibrate.measure_plan_costs(index, catalog["x"][:BATCH])
    assert seen and all(s == index.stats.model_copy(update={"plan_costs": ()}) for s in seen)


def test_the_plans_are_timed_on_one_thread_and_the_threads_restored(index, catalog, monkeypatch):
    """Both plans run on one thread while timed (their ratio is what the planner reads; a
    parallel run on a shared machine times its threads' waits), and the caller's thread count
    comes back, also when a timed run fails."""
    import retrieval.index.calibrate as calibrate

    threads: list[int] = []
    timed = calibrate._list_plan

    def spy(*args, **kwargs):
        threads.append(torch.get_num_threads())
        return timed(*args, **kwargs)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(calibrate, "_list_plan", spy)
        calibrate.measure_plan_costs(index, catalog["x"][:BATCH])
        assert threads and set(threads) == {1} and torch.get_num_threads() == 2

        def fails(*args, **kwargs):
            raise RuntimeError("a timed run failed")

        monkeypatch.setattr(calibrate, "_list_plan", fails)
        with pytest.raises(RuntimeError):
            calibrate.measure_plan_costs(index, catalog["x"][:BATCH])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
