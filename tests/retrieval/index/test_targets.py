"""A recall target per request (``retrieval/index/targets.py``): the curves the build measures,
the settings a target reads off them, and the recall it gets, filtered (anti-correlated data,
every selectivity) and not."""

from __future__ import annotations

import pytest
import torch

from retrieval.data.anticorrelated import SELECTIVITIES, AntiCorrelated, anticorrelated
from retrieval.index import IVFConfig, IVFIndex, build_ivf, exact_search
from retrieval.index.exact import recall_at_k
from retrieval.index.targets import row_settings
from support.anticorrelated_truth import filtered_truth

K = 100
CURVE = ((1, 0.5), (2, 0.7), (4, 0.9), (8, 0.97))
SLACKS = ((0.5, 0.2), (0.9, 0.4), (0.99, 0.7))


def test_row_settings_read_the_curves():
    t = torch.tensor([0.0, 0.6, 0.9, 0.95, 0.99, 1.0])
    s = row_settings(t, nprobe=16, slack=0.33, recall_curve=CURVE, slack_curve=SLACKS)
    assert s.nprobe.tolist()[:5] == [16, 2, 4, 8, 8]  # 0: the index's own nprobe
    assert s.slack.tolist() == pytest.approx([0.33, 0.4, 0.4, 0.7, 0.7, 1.0])
    # 0.99 is above every measured point, and 1 asks for exactness: both scan exactly
    assert s.exact.tolist() == [False, False, False, False, True, True]
    with pytest.raises(ValueError, match="measured no recall curve"):
        row_settings(torch.tensor([0.9]), 16, 0.3, (), SLACKS)
    assert row_settings(torch.tensor([1.0]), 16, 0.3, (), SLACKS).exact.tolist() == [True]


@pytest.fixture(scope="module")
def data() -> AntiCorrelated:
    return anticorrelated(20_000, 32, 200, n_centres=200, homes=20, neighbourhood=0.05, seed=0)


@pytest.fixture(scope="module")
def index(data) -> IVFIndex:
    cfg = IVFConfig(nlist=128, nprobe=8, target_recall=0.9)
    return build_ivf(
        data.x,
        cfg,
        item_attributes=data.attributes,
        attribute_values=data.attribute_values,
        tune_queries=data.q[::2],  # tuned on half the queries, measured on all
    )


def test_build_records_both_curves(index):
    curve = index.stats.recall_curve
    probes = [p for p, _ in curve]
    assert probes == sorted(probes) and probes[0] == 1
    assert curve[-1][1] >= 0.995 or probes[-1] == index.nlist
    assert index.config.nprobe == next(p for p, rec in curve if rec >= 0.9)
    slacks = [s for _, s in index.stats.slack_curve]
    assert slacks == sorted(slacks) and 0 < slacks[0] < slacks[-1] <= 1


def test_unfiltered_recall_meets_each_target(data, index):
    q, x = torch.from_numpy(data.q), torch.from_numpy(data.x)
    truth, _ = exact_search(x, q, K)
    for target in (0.5, 0.8, 0.9, 0.95, 0.99):
        ids, _ = index.search(q, K, recall_target=target)
        assert recall_at_k(ids, truth) >= target - 0.01, target  # an average over queries
    # 1: the exact plan, over the vectors the index holds (codes decoded: no exact copy here)
    ids, _ = index.search(q, K, recall_target=1.0)
    pos, _ = index.search(q, K, nprobe=1, rerank=0, exact=True, positions=True)
    assert torch.equal(ids, index.item_ids[pos]) and recall_at_k(ids, truth) >= 0.999


@pytest.mark.parametrize("selectivity", SELECTIVITIES)
def test_filtered_recall_meets_each_target_at_every_selectivity(data, index, selectivity):
    truth = filtered_truth(data, selectivity, K)
    texts = data.filters(selectivity)
    got = {}
    for target in (0.9, 0.95, 0.99):
        ids, _ = index.search(data.q, K, texts, recall_target=target)
        got[target] = recall_at_k(ids, truth)
        assert got[target] >= target - 0.01, (target, got)
    assert got[0.99] >= got[0.9] - 0.005  # a stricter target never does worse


def test_targets_differ_per_row(data, index):
    """One batch, three targets: each row is searched as if alone with its own."""
    q = torch.from_numpy(data.q[:6])
    targets = torch.tensor([0.5, 0.99, 0.0, 1.0, 0.8, 0.9])
    ids, _ = index.search(q, K, recall_target=targets)
    for row, t in enumerate(targets.tolist()):
        alone, _ = index.search(q[row : row + 1], K, recall_target=t or None)
        assert torch.equal(ids[row], alone[0])
    plan = index.plan(index.schema.empty(6), index.params(K, rerank=0, target=targets))
    assert bool(plan.exact[3]) and int(plan.nprobe[1]) >= int(plan.nprobe[0])


def test_bad_targets_are_refused(index):
    q = torch.zeros(2, index.dim)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="recall_target"):
            index.search(q, 5, recall_target=bad)
    plain = build_ivf(torch.randn(500, 8), IVFConfig(nlist=8, target_recall=0.0))
    with pytest.raises(ValueError, match="measured no recall curve"):
        plain.search(torch.zeros(1, 8), 5, recall_target=0.9)
