"""A version's config and the model-level ``config.pbtxt`` (issue 18, "publish atomicity").

Each version carries its own ``config.pbtxt`` in its manifest; the model-level copy (for Triton) is
replaced only after the version's rename, so a publish killed between the two leaves a new
version beside the old config. What must hold: whatever a kill -9 leaves, a server started on the
repository serves the latest version with that version's own batching, and the model-level copy
is repaired to match it (atomically; never while a publisher holds the lock; a read-only
repository is served anyway).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from disk_faults import ReadOnly
from publish_worker import HALT_POINTS, Worker

from retrieval.artifact import save_model
from serving.app.config import ServeConfig
from serving.app.server import Server
from serving.repository.config import CONFIG_FILE, read_config
from serving.repository.manifest import CorruptVersionError, write_manifest
from serving.repository.model_folder import LOCK_FILE, locked
from serving.repository.repository import ModelRepository
from serving.repository.tritonserver import TritonUnavailable, triton_launch

NAME = "demo"
OLD_MBS, NEW_MBS = 8, 16
WAIT = 60.0


def own(repo: ModelRepository, version: int) -> bytes:
    return (repo.version_dir(NAME, version) / CONFIG_FILE).read_bytes()


def model_level(repo: ModelRepository) -> Path:
    return repo.model_dir(NAME) / CONFIG_FILE


@pytest.fixture
def two(tiny, repo: ModelRepository) -> ModelRepository:
    """Versions 1 (max_batch_size 8) and 2 (16), the model-level config left at version 1's:
    what a publish killed between its rename and its config write leaves."""
    assert repo.publish(NAME, tiny.model, max_batch_size=OLD_MBS) == 1
    assert repo.publish(NAME, tiny.model, max_batch_size=NEW_MBS) == 2
    model_level(repo).write_bytes(own(repo, 1))
    return repo


# ---- the repair path ---------------------------------------------------------------------------
def test_load_serves_the_versions_own_config_and_repairs_the_model_level_one(two) -> None:
    assert read_config(model_level(two)).max_batch_size == OLD_MBS  # the hole
    assert two.config(NAME).max_batch_size == NEW_MBS  # the truth: version 2's own
    assert two.config(NAME, 1).max_batch_size == OLD_MBS
    loaded = two.load(NAME)
    assert loaded.version == 2 and loaded.config.max_batch_size == NEW_MBS
    assert model_level(two).read_bytes() == own(two, 2)  # healed, and atomically: no temp left
    assert sorted(p.name for p in two.model_dir(NAME).iterdir()) == [
        LOCK_FILE,
        "1",
        "2",
        CONFIG_FILE,
    ]
    assert not two.repair_config(NAME)  # agrees now
    assert two.load(NAME, 1).config.max_batch_size == OLD_MBS  # each version its own
    assert model_level(two).read_bytes() == own(two, 2)  # an older load repairs to the latest


def test_repair_writes_a_missing_or_hostile_model_level_config_without_parsing_it(two) -> None:
    model_level(two).unlink()
    assert two.repair_config(NAME) and model_level(two).read_bytes() == own(two, 2)
    model_level(two).write_bytes(b"\x80\x04 not text, not a config")  # compared, never parsed
    assert two.load(NAME).config.max_batch_size == NEW_MBS
    assert model_level(two).read_bytes() == own(two, 2)


def test_repair_leaves_the_config_to_a_publisher_holding_the_lock(two) -> None:
    with locked(two.model_dir(NAME) / LOCK_FILE) as held:  # as a publish in progress does
        assert held
        assert not two.repair_config(NAME)  # that publish writes the config last
        assert two.load(NAME).config.max_batch_size == NEW_MBS  # served right all the same
        assert model_level(two).read_bytes() == own(two, 1)
    assert two.repair_config(NAME) and model_level(two).read_bytes() == own(two, 2)


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES], ids=["EROFS", "EACCES"])
def test_a_read_only_repository_is_served_by_the_versions_config(two, monkeypatch, err) -> None:
    with monkeypatch.context() as mp:
        ReadOnly(two.root if err == errno.EROFS else two.model_dir(NAME), err).install(mp)
        assert not two.repair_config(NAME)  # logged, not raised
        assert two.load(NAME).config.max_batch_size == NEW_MBS
    assert model_level(two).read_bytes() == own(two, 1)


def test_a_version_without_its_own_config_serves_the_model_level_one(two) -> None:
    """Versions published before they carried a config: nothing to repair from."""
    vdir = two.version_dir(NAME, 2)
    (vdir / CONFIG_FILE).unlink()
    write_manifest(vdir, model=NAME, version=2)
    assert not two.repair_config(NAME)
    assert two.load(NAME).config.max_batch_size == OLD_MBS
    assert model_level(two).read_bytes() == own(two, 1)


def test_a_versions_config_that_is_not_its_manifests_is_refused(two) -> None:
    vdir = two.version_dir(NAME, 2)
    (vdir / CONFIG_FILE).write_bytes(own(two, 1))  # same size, other bytes
    with pytest.raises(CorruptVersionError, match=r"config\.pbtxt"):
        two.config(NAME)
    with pytest.raises(CorruptVersionError, match=r"config\.pbtxt"):
        two.load(NAME)
    assert not two.repair_config(NAME)  # never copies unverified bytes
    assert model_level(two).read_bytes() == own(two, 1)


def test_triton_launch_repairs_the_config_triton_reads(two, tmp_path) -> None:
    try:
        triton_launch(two.root, tmp_path)  # builds the command; starts nothing
    except TritonUnavailable as e:
        pytest.skip(str(e))
    assert model_level(two).read_bytes() == own(two, 2)


# ---- kill -9 around the config write -----------------------------------------------------------
@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory) -> Any:
    folder = tmp_path_factory.mktemp("halt-worker")
    w = Worker(save_model(tiny.model, folder / "model"), folder / "stderr.txt")
    yield w
    w.close()


def serve(root: Path) -> Server:
    config = ServeConfig(model_repo=root, model=NAME, grpc_port=0, poll_s=0.0, close_linger_s=0.0)
    server = Server(config, extra_servicers=[])
    server.start()
    return server


@pytest.mark.slow
@pytest.mark.multiproc  # the publish worker process
@pytest.mark.parametrize("point", HALT_POINTS)
def test_kill_9_around_the_config_write_serves_each_versions_own_batching(
    tiny, tmp_path, worker, point
) -> None:
    repo = ModelRepository(tmp_path / "repo")
    assert repo.publish(NAME, tiny.model, max_batch_size=OLD_MBS) == 1
    old = model_level(repo).read_bytes()
    lines = worker.run("halt", repo.root, NAME, point, NEW_MBS, kill_on="at")
    said = [w[0] for w in lines]
    assert "at" in said and lines[said.index("at")][2] == point, lines
    assert lines[-1][2:] == ["signal", "9"] and "done" not in said, lines
    # what the kill left, before any reader repairs it
    published = point != "before-rename"
    assert repo.versions(NAME) == ([1, 2] if published else [1])
    in_the_hole = point in ("after-rename", "before-config")
    assert model_level(repo).read_bytes() == (own(repo, 2) if point == "after-config" else old)
    want_version, want_mbs = (2, NEW_MBS) if published else (1, OLD_MBS)

    server = serve(repo.root)
    try:
        assert server.host.version == want_version
        assert server.state is not None
        assert server.state.batcher.policy.max_batch_size == want_mbs
        loaded = server.host.loaded
        assert loaded is not None and loaded.config == read_config(loaded.path / CONFIG_FILE)
    finally:
        server.drain_and_stop(timeout=WAIT)
    assert model_level(repo).read_bytes() == own(repo, want_version)  # healed (or never broken)
    assert read_config(model_level(repo)).max_batch_size == want_mbs
    print(f"\nkill -9 at {point}: served v{want_version}, mbs {want_mbs}, repaired={in_the_hole}")

    # the next publish removes what the killed one left and leaves a consistent pair
    assert repo.publish(NAME, tiny.model, max_batch_size=32) == want_version + 1
    assert model_level(repo).read_bytes() == own(repo, want_version + 1)
    mdir = repo.model_dir(NAME)
    assert [p.name for p in mdir.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE] == []
