"""The CLI as a user runs it: a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from retrieval.artifact import load_model


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_the_jobs():
    out = run("--help")
    assert out.returncode == 0
    for job in ("demo", "fetch-movielens", "bench-ann"):
        assert job in out.stdout


@pytest.mark.slow
def test_demo_on_synthetic_data_trains_serves_and_saves(tmp_path: Path):
    out = run("demo", "--data", "synthetic", "--epochs", "2", "--quiet", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "recall@100" in out.stdout and "popularity baseline" in out.stdout
    assert "same results: True" in out.stdout
    model = load_model(tmp_path / "model")
    assert model.index.ntotal == 5000


def test_demo_rejects_unknown_data():
    out = run("demo", "--data", "nope", "--quiet")
    assert out.returncode != 0 and "synthetic" in (out.stdout + out.stderr)
