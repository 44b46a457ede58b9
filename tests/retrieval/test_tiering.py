"""The foundation model on tiered, quantized tables: recall vs FP32, compile, save/load, bad ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrieval.artifact import load_model, save_model
from retrieval.metrics import ranking_metrics
from retrieval.tiering import tier_model
from sharded_tables.planner import Budgets
from sharded_tables.specs import DType, Tier
from sharded_tables.tiered import TieredEmbeddingCollection

HOST_ONLY = Budgets(device=0, host=1 << 30)

pytestmark = pytest.mark.slow  # the trained fixture


@pytest.fixture(scope="module")
def trained(trained_synthetic):
    """The model ``test_model.py`` reads too (``tests/retrieval/conftest.py``), trained once;
    ``tier_model`` leaves it as it is."""
    prep, model, _ = trained_synthetic
    return prep, model


def _recall(prep, model, users) -> float:
    with torch.inference_mode():
        recs = model(prep.user_batch(users), 100)[0].numpy()
    return ranking_metrics(recs, [prep.test_items[u] for u in users], 100)["recall@100"]


def test_int8_tables_keep_recall_within_half_a_point(trained):
    prep, model = trained
    users = np.array([u for u in range(prep.dataset.num_users) if prep.test_items[u]])
    fp32 = _recall(prep, model, users)
    for dtype, tolerance in ((DType.INT8, 0.005), (DType.FP8, 0.01), (DType.INT4, 0.03)):
        tiered, remote = tier_model(model, HOST_ONLY, dtype=dtype)
        assert remote == {} and isinstance(tiered.tables, TieredEmbeddingCollection)
        assert all(
            p.dtype is dtype and p.tier is not Tier.REMOTE for p in tiered.tables.plan.tables
        )
        assert abs(_recall(prep, tiered, users) - fp32) <= tolerance, dtype


def test_planner_quantizes_only_when_the_budget_demands_it(trained):
    _, model = trained
    roomy, _ = tier_model(model, HOST_ONLY, dtype=DType.FP32, allowed=(DType.INT8,))
    assert {p.dtype for p in roomy.tables.plan.tables} == {DType.FP32}
    fp32_bytes = sum(p.bytes for p in roomy.tables.plan.tables)
    tight, _ = tier_model(
        model, Budgets(device=0, host=fp32_bytes // 2), dtype=DType.FP32, allowed=(DType.INT8,)
    )
    assert DType.INT8 in {p.dtype for p in tight.tables.plan.tables}


@pytest.mark.multiproc  # inductor compile workers
def test_tiered_model_compiles_saves_and_loads(trained, tmp_path):
    prep, model = trained
    tiered, _ = tier_model(model, HOST_ONLY, dtype=DType.INT8)
    batch = prep.user_batch(np.arange(16), [None] * 8 + ["region in {eu, na}"] * 8)
    with torch.inference_mode():
        eager = tiered(batch, 50)
        compiled = torch.compile(tiered)(batch, 50)
    assert torch.equal(eager[0], compiled[0])
    save_model(tiered, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.config.table_plan == tiered.config.table_plan
    with torch.inference_mode():
        again = loaded(batch, 50)
    assert torch.equal(eager[0], again[0])
    torch.testing.assert_close(eager[1], again[1])


def test_out_of_range_ids_name_the_table_and_the_id(trained):
    prep, model = trained
    tiered, _ = tier_model(model, HOST_ONLY, dtype=DType.INT8)
    batch = prep.user_batch(np.arange(2))
    batch.history[0, 0] = 10**9
    with pytest.raises(ValueError, match=r"id 1000000000 is out of range for table 'item'"):
        tiered(batch, 10)


@pytest.mark.gpu
def test_tiered_model_on_cuda_matches_cpu(trained):
    prep, model = trained
    cpu, _ = tier_model(model, HOST_ONLY, dtype=DType.INT8)
    gpu, _ = tier_model(
        model, Budgets(device=1 << 30, host=0, has_gpu=True), dtype=DType.INT8, device="cuda"
    )
    gpu = gpu.to("cuda")
    assert {p.tier for p in gpu.tables.plan.tables} == {Tier.DEVICE}
    batch = prep.user_batch(np.arange(64), [None] * 32 + ["region in {eu, na}"] * 32)
    with torch.inference_mode():
        want, _ = cpu(batch, 50)
        got, _ = gpu(batch.to("cuda"), 50)
    assert got.is_cuda
    overlap = sum(
        len(set(a) & set(b)) for a, b in zip(got.cpu().tolist(), want.tolist(), strict=True)
    )
    assert overlap / want.numel() >= 0.97  # int8 tables; the CUDA index scan is the Triton kernel
