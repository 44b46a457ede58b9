"""bench/gpu_device_path.py on the CPU (its smoke run): every cell holds each system's timing
and recall, the device path's agreement with the host path, and the per-round ratios."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_device_path


def test_a_smoke_run_records_every_cell(tmp_path: Path) -> None:
    out = tmp_path / "gpu_device.json"
    args = ["--device", "cpu", "--size", "3000", "--dim", "16", "--batches", "1,2", "--k", "10"]
    args += ["--rounds", "1", "--budget-s", "0.01", "--out", str(out)]
    report = gpu_device_path.main(args)
    assert json.loads(out.read_text()) == report
    assert len(report["cells"]) == 4  # two filters x two batches
    for cell in report["cells"]:
        for system in gpu_device_path.SYSTEMS:
            assert cell[system]["p50_ms"] > 0 and 0.0 <= cell[system]["recall"] <= 1.0
        assert cell["same_ids_graphed"] == 1.0  # no graph on the CPU: the same eager path
        assert 0.0 <= cell["same_ids"] <= 1.0 and cell["graphed_over_host"] > 0
