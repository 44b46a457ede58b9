"""GPU tiers (skipped without CUDA): device tier in HBM, host tier in pinned DRAM, caches in HBM.

Each result must equal the CPU path's on the same packed rows. Without fbgemm-gpu's CUDA kernels
(the CPU build is installed here) the tiers use the torch backend, which these tests cover; with
them, the fbgemm backend (DEVICE / MANAGED_CACHING) is what runs.
"""

from __future__ import annotations

import pytest
import torch

from sharded_tables.planner import Budgets, PlacementPlan, TablePlacement
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.tbe import LocalTable, LocalTables
from sharded_tables.tiered import TieredEmbeddingCollection

pytestmark = pytest.mark.gpu

TABLES = [
    LocalTable("a", 300, 16, DType.INT8, ("a", "a2")),
    LocalTable("b", 50, 8, DType.INT4, ("b",), pooling="sum"),
    LocalTable("c", 40, 8, DType.FP8, ("c",)),
    LocalTable("d", 40, 4, DType.FP16, ("d",)),
]


def _ids(seed: int, b: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = {"a": 300, "a2": 300, "b": 50, "c": 40, "d": 40}
    return [torch.randint(-1, rows[f], (b, 5), generator=g) for f in ("a", "a2", "b", "c", "d")]


@pytest.mark.parametrize("tier", ["device", "host"])
def test_cuda_tiers_equal_the_cpu_path(tier: str):
    cpu = LocalTables(TABLES, backend="torch")
    gpu = LocalTables(TABLES, tier=tier, device="cuda")
    for t in TABLES:
        w = torch.randn(t.rows, t.dim, generator=torch.Generator().manual_seed(len(t.name)))
        cpu.set_float(t.name, w)
        gpu.set_float(t.name, w)
    if gpu.backend == "torch":
        pinned = [p.is_pinned() for p in gpu._packed]
        on_gpu = [p.is_cuda for p in gpu._packed]
        assert all(pinned) if tier == "host" else all(on_gpu)
    for seed in range(5):
        ids = _ids(seed)
        want = cpu.forward_padded(ids)
        got = gpu.forward_padded([i.cuda() for i in ids])
        assert got.is_cuda
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


class PackedRows:
    def __init__(self, packed):
        self.packed = packed
        self.calls = 0

    def fetch(self, ids_by_table, timeout=None):
        self.calls += 1
        return {t: self.packed[t][ids] for t, ids in ids_by_table.items()}


def test_collection_on_cuda_with_a_remote_table_cached_in_hbm():
    specs = [
        TableSpec("item", 300, 16, DType.INT8, features=("history",)),
        TableSpec("country", 20, 8, DType.FP16, pooling="sum"),
        TableSpec("user", 500, 8, DType.INT8),
    ]
    budgets = Budgets(
        device=1 << 20, host=1 << 20, remote_per_server=1 << 20, remote_servers=1, has_gpu=True
    )
    placement = PlacementPlan(
        (
            TablePlacement("item", Tier.DEVICE, DType.INT8, specs[0].bytes()),
            TablePlacement("country", Tier.HOST, DType.FP16, specs[1].bytes()),
            TablePlacement(
                "user",
                Tier.REMOTE,
                DType.INT8,
                specs[2].bytes(),
                servers=(0,),
                partition="range",
                row_bounds=(0, 500),
                cache_rows=64,
            ),
        ),
        budgets,
    )
    weights = {s.name: torch.randn(s.rows, s.dim) for s in specs}
    cpu = TieredEmbeddingCollection(specs, placement)
    cpu.remote = PackedRows(cpu.load_float(weights))
    gpu = TieredEmbeddingCollection(specs, placement, device="cuda")
    gpu.remote = server = PackedRows(gpu.load_float(weights))
    assert gpu.caches["user"].storage.is_cuda
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        feats = {
            "history": torch.randint(-1, 300, (9, 6), generator=g),
            "country": torch.randint(-1, 20, (9, 2), generator=g),
            "user": torch.randint(0, 40, (9, 3), generator=g),  # hot ids: cached after round 1
        }
        want = cpu(feats)
        got = gpu({f: t.cuda() for f, t in feats.items()})
        for f in feats:
            assert got[f].is_cuda
            torch.testing.assert_close(got[f].cpu(), want[f], rtol=1e-5, atol=1e-5)
    assert gpu.cache_stats()["user"]["hits"] > 0 and server.calls >= 1
