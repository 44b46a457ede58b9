"""Runs shared by the files that compare torchrun jobs (each 2-rank job is ~10 s here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.train_runs import train

PUBLISH = '[publish]\nmodel_repo = "{repo}"\nname = "demo"\ntable_dtype = "fp32"'


@pytest.fixture(scope="session")
def table_wise(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run with the default (table-wise) sharding that publishes (fp32 tables) into
    ``<run>/../repo``."""
    tmp = tmp_path_factory.mktemp("tw")
    return train(tmp, "two", nproc=2, extra=PUBLISH.format(repo=tmp / "repo"))
