"""Shared fixtures: seeded synthetic vectors; GPU tests skip without CUDA."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import settings

from common.logs import reset_rate_limits

torch.set_num_threads(2)

# Triton kernels run on the CPU through Triton's interpreter where no GPU is (it is read when a
# kernel module is imported, so before any test imports one).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# child_guard: a test that starts a child process must be marked multiproc (it fails otherwise).
pytest_plugins = ["support.serving_fixtures", "support.child_guard", "pytester"]

# Property tests draw the same examples on every run (CI must not turn red by chance); set
# HYPOTHESIS_PROFILE=explore to draw new ones, and keep any failure it finds as a regular test.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def _fresh_log_rate_limits() -> None:
    """Log rate limits (``common/logs.py``) start empty: one test's refusals must not silence
    the lines another test looks for."""
    reset_rate_limits()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        for item in items:  # Triton's first compile in a process starts a helper process
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.multiproc)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def clustered(n: int, d: int, centres: int, seed: int) -> torch.Tensor:
    """The benchmark's distribution: Gaussian centres scaled x3 plus unit noise."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(centres, d, generator=g) * 3
    return c[torch.randint(0, centres, (n,), generator=g)] + torch.randn(n, d, generator=g)


@pytest.fixture(scope="session")
def catalog() -> dict:
    """20k clustered items (dim 32) with two independent filter attributes, and 64 queries."""
    n, d = 20_000, 32
    x = clustered(n, d, 100, seed=0)
    g = torch.Generator().manual_seed(7)
    c = torch.randn(100, d, generator=torch.Generator().manual_seed(0)) * 3
    q = c[torch.randint(0, 100, (64,), generator=g)] + torch.randn(64, d, generator=g)
    rng = np.random.default_rng(1)
    attrs = {"shard": rng.integers(0, 32, n), "bucket": rng.integers(0, 32, n)}
    values = {a: [str(i) for i in range(32)] for a in attrs}
    return {"x": x, "q": q, "attrs": attrs, "values": values}
