"""Repository fixtures: a fresh repository folder per test (the tiny model comes from
``tests/support/serving_fixtures.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.repository.repository import ModelRepository


@pytest.fixture
def repo(tmp_path: Path) -> ModelRepository:
    return ModelRepository(tmp_path / "repo")
