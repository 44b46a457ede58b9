"""Serving fixtures (a pytest plugin of ``tests/conftest.py``, so every test folder has them): a tiny trained-shape model (untrained weights, real index) and an
in-memory stand-in for ``model_repo.ModelRepository`` (latest / versions / load)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from retrieval.data import SyntheticConfig, generate
from retrieval.training.prepare import prepare
from serving.app.config import ServeConfig
from support.tiny_model import StandInRepo, Tiny


@pytest.fixture(scope="session")
def tiny() -> Tiny:
    ds = generate(SyntheticConfig(num_users=100, num_items=300, seed=1))
    prep = prepare(ds, history_len=8)
    t = Tiny(prep, None)  # type: ignore[arg-type]
    t.model = t.build(0)
    return t


@pytest.fixture
def repo(tiny: Tiny) -> StandInRepo:
    r = StandInRepo()
    r.publish(tiny.model)
    return r


@pytest.fixture
def empty_repo() -> StandInRepo:
    return StandInRepo()


@pytest.fixture
def serve_config(tmp_path: Path) -> Callable[..., ServeConfig]:
    """``serve_config(**overrides)``: a loopback test server's config over ``tmp_path`` (free
    ports, no polling, no linger) holding a ``demo`` model folder."""
    (tmp_path / "demo").mkdir(exist_ok=True)
    (tmp_path / "demo" / "config.pbtxt").write_text('name: "demo"\n')

    def make(**overrides: Any) -> ServeConfig:
        base: dict[str, Any] = {
            "model_repo": tmp_path,
            "grpc_port": 0,
            "metrics_port": 0,
            "poll_s": 0.0,
            "close_linger_s": 0.0,
        }
        return ServeConfig(**{**base, **overrides})

    return make


@pytest.fixture(scope="session", params=["plain", "head+rerank"])
def wide(request: pytest.FixtureRequest) -> Tiny:
    """12,000 items (K up to 10,000 fits), untrained weights; "head+rerank": a scoring head
    (candidates' vectors cross the wire) and an exact re-rank of 300 candidates."""
    ds = generate(SyntheticConfig(num_users=64, num_items=12_000, seed=3))
    prep = prepare(ds, history_len=8)
    if request.param != "plain":
        prep.config.scoring_head = True
        prep.config.index.rerank = 300
    t = Tiny(prep, None)  # type: ignore[arg-type]
    t.model = t.build(0)
    return t
