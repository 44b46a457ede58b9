"""Runs shared by the files that compare torchrun jobs (each 2-rank job is ~10 s here)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sharded_tables.hashed_training import store_folder
from sharded_tables.remote.server import EmbeddingServer
from support.train_runs import train

PUBLISH = '[publish]\nmodel_repo = "{repo}"\nname = "demo"\ntable_dtype = "fp32"'


@pytest.fixture(scope="session")
def table_wise(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run with the default (table-wise) sharding that publishes (fp32 tables) into
    ``<run>/../repo``."""
    tmp = tmp_path_factory.mktemp("tw")
    return train(tmp, "two", nproc=2, extra=PUBLISH.format(repo=tmp / "repo"))


@dataclass
class HashedRun:
    """A 2-rank run with a hashed raw-id feature (a working table of 128 rows) whose other rows
    live on ``server`` (in this process, still serving); ``lines`` are its config's extra
    lines, for more runs against the same server."""

    run: Path
    server: EmbeddingServer
    lines: dict[str, str]


@pytest.fixture(scope="session")
def hashed_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HashedRun]:
    """Shared by the tests that compare a hashed 2-rank run with one process and with a
    killed-and-resumed job: a fresh run empties the server's table first, so a later run on
    the same server trains as on a new one."""
    tmp = tmp_path_factory.mktemp("hashed")
    server = EmbeddingServer(store_folder(tmp / "store", {"user_raw_id": 16 + 1}))  # + Adagrad
    address = server.start()
    lines = {"train": f'[train.hashed]\nservers = ["{address}"]', "model": "hashed_user_id = 128"}
    try:
        yield HashedRun(train(tmp, "two", nproc=2, **lines), server, lines)
    finally:
        server.stop(grace=0)
