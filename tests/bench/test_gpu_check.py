"""bench/gpu.py on the CPU: ``--check``'s kernel check under Triton's interpreter
(``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` where no GPU is), so a GPU run's check cannot
break on a changed kernel API unseen, and a smoke run of the timed part."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu

from retrieval.index import gpu_scan
from retrieval.index.tensors import Lists, ScanRows

# Where CUDA is, conftest leaves Triton compiled: CPU tensors cannot reach the kernel there, and
# bench/gpu_check.sh runs the check on the GPU itself (`bench/gpu.py --check`).
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs off CUDA")


@interpreted
def test_the_kernel_check_passes_on_both_kernel_paths() -> None:
    report = gpu.check_kernel("cpu")
    assert report["ok"] and report["index"] > 0.99
    assert report["select"] == report["full"] == 4  # INT8 and FP8, r 10 / 100 and 200 / 1000
    assert report["cases"] == 2 * len(gpu.SCAN_CASES)


@interpreted
def test_the_kernel_check_fails_on_a_wrong_score(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check compares what the kernel returns: a kernel off by one score is caught."""

    def off_by_one(lists: Lists, rows: ScanRows, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos, scores = gpu.scan_reference(lists, rows, r)
        return pos, torch.where(scores.isfinite(), scores + 1e-3, scores)

    monkeypatch.setattr(gpu_scan, "scan_triton", off_by_one)
    with pytest.raises(AssertionError, match="not close"):
        gpu.check_scan("cpu")


def test_a_smoke_run_records_every_cell(tmp_path: Path) -> None:
    out = tmp_path / "gpu_cpu.json"
    args = ["--device", "cpu", "--sizes", "3000", "--dim", "16", "--batches", "1,4"]
    args += ["--ks", "10", "--selectivities", "1,0.05", "--nprobes", "4,8", "--budget-s", "0.01"]
    gpu.main([*args, "--out", str(out)])
    report = json.loads(out.read_text())
    (size,) = report["sizes"]
    assert size["n"] == 3000 and size["nprobe"] in (4, 8)
    assert len(size["rows"]) == 4  # two filters x two batches
    for row in size["rows"]:
        assert row["ours"]["p50_ms"] > 0 and "brute" not in row  # no GEMM baseline on the CPU
    assert "3,000 items" in gpu.render(report)
