"""ModelRepository: atomic publish, complete versions only, retention, locking, verified loads."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from serving.repository.config import CONFIG_FILE, read_config
from serving.repository.manifest import MANIFEST_FILE, CorruptVersionError
from serving.repository.model_folder import STAGING_PREFIX
from serving.repository.repository import (
    ARTIFACT_DIR,
    BACKEND_FILE,
    BACKEND_SOURCE,
    LOCK_FILE,
    ModelRepository,
)

USERS = np.arange(6)


def test_publish_then_load_answers_like_the_model(tiny, repo: ModelRepository) -> None:
    assert repo.models() == [] and repo.versions("demo") == [] and repo.latest("demo") is None
    v = repo.publish("demo", tiny.model, max_batch_size=16)
    assert v == 1 and repo.versions("demo") == [1] and repo.models() == ["demo"]
    vdir = repo.root / "demo" / "1"
    assert sorted(p.name for p in vdir.iterdir()) == sorted(
        [CONFIG_FILE, MANIFEST_FILE, ARTIFACT_DIR, BACKEND_FILE]
    )
    assert (vdir / BACKEND_FILE).read_bytes() == BACKEND_SOURCE.read_bytes()
    assert sorted(p.name for p in (repo.root / "demo").iterdir()) == [LOCK_FILE, "1", CONFIG_FILE]
    loaded = repo.load("demo")
    assert (loaded.name, loaded.version, loaded.path) == ("demo", 1, vdir)
    assert not loaded.model.training
    assert loaded.config.max_batch_size == 16 and loaded.config_pb is loaded.config
    assert list(loaded.config.dynamic_batching.preferred_batch_size) == []  # work-conserving
    assert loaded.config == read_config(repo.root / "demo" / CONFIG_FILE)
    assert loaded.config == read_config(vdir / CONFIG_FILE)  # the version's own, in its manifest
    want = tiny.expected(tiny.model, USERS, 10)
    got = tiny.expected(loaded.model, USERS, 10)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_versions_count_up_and_load_picks_one(tiny, repo: ModelRepository) -> None:
    other = tiny.build(1)
    assert repo.publish("demo", tiny.model) == 1
    assert repo.publish("demo", other) == 2
    assert repo.latest("demo") == 2
    for version, model in ((1, tiny.model), (2, other), (None, other)):
        got = tiny.expected(repo.load("demo", version).model, USERS, 5)[0]
        np.testing.assert_array_equal(got, tiny.expected(model, USERS, 5)[0])
    with pytest.raises(FileNotFoundError, match="version 3 not found"):
        repo.load("demo", 3)
    with pytest.raises(FileNotFoundError, match="no published version"):
        repo.load("other")


def test_crashed_publish_is_invisible(tiny, repo: ModelRepository) -> None:
    """A staging folder left by a crash, or a numbered folder without a manifest, is no version."""
    repo.publish("demo", tiny.model)
    mdir = repo.root / "demo"
    stage = mdir / f"{STAGING_PREFIX}crashed"
    (stage / ARTIFACT_DIR).mkdir(parents=True)
    (stage / ARTIFACT_DIR / "model.pt").write_bytes(b"half a file")
    (mdir / "2" / ARTIFACT_DIR).mkdir(parents=True)  # no manifest: never completed
    assert repo.versions("demo") == [1] and repo.latest("demo") == 1
    assert repo.load("demo").version == 1
    # the next publish skips the taken number and leaves a fresh staging folder alone
    assert repo.publish("demo", tiny.model) == 3
    assert repo.versions("demo") == [1, 3]
    assert stage.is_dir()
    # an hour later the crashed stage is garbage; the next publish removes it
    old = time.time() - 2 * 3600
    os.utime(stage, (old, old))
    repo.publish("demo", tiny.model)
    assert not stage.exists()
    assert not [p for p in mdir.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE]


def test_models_are_folders_with_a_config_or_a_version(tiny, repo: ModelRepository) -> None:
    repo.publish("demo", tiny.model)
    repo.publish("b.model-2", tiny.model)
    for junk in ("__pycache__", ".staging-x", "no_config_no_version"):
        (repo.root / junk).mkdir()
    (repo.root / "notes.txt").write_text("not a model")
    assert repo.models() == ["b.model-2", "demo"]


def test_failed_publish_leaves_nothing(tiny, repo: ModelRepository, monkeypatch) -> None:
    repo.publish("demo", tiny.model)
    import serving.repository.repository as r

    def boom(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(r, "write_manifest", boom)
    with pytest.raises(OSError, match="disk full"):
        repo.publish("demo", tiny.model)
    assert repo.versions("demo") == [1]
    assert sorted(p.name for p in (repo.root / "demo").iterdir()) == [LOCK_FILE, "1", CONFIG_FILE]


def test_retention_keeps_the_newest(tiny, repo: ModelRepository) -> None:
    for _ in range(5):
        repo.publish("demo", tiny.model, keep=2)
    assert repo.versions("demo") == [4, 5]
    assert repo.publish("demo", tiny.model, keep=1) == 6
    assert repo.versions("demo") == [6]
    assert sorted(p.name for p in (repo.root / "demo").iterdir()) == [LOCK_FILE, "6", CONFIG_FILE]
    with pytest.raises(ValueError, match=r"^keep:"):
        repo.publish("demo", tiny.model, keep=0)


def test_concurrent_publishes_get_distinct_versions(tiny, repo: ModelRepository) -> None:
    results: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def publish() -> None:
        try:
            start.wait()
            results.append(repo.publish("demo", tiny.model, keep=10))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=publish) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(results) == [1, 2, 3, 4] == repo.versions("demo")
    for v in results:
        repo.load("demo", v)  # each verifies: nobody wrote into another's version


def test_corrupt_version_is_refused_and_the_previous_loads(tiny, repo: ModelRepository) -> None:
    repo.publish("demo", tiny.model)
    repo.publish("demo", tiny.build(2))
    weights = repo.root / "demo" / "2" / ARTIFACT_DIR / "model.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptVersionError, match=r"model/model\.pt: sha256 mismatch"):
        repo.load("demo")
    assert repo.load("demo", 1).version == 1
    # a version folder copied under another number is refused too
    os.rename(repo.root / "demo" / "1", repo.root / "demo" / "9")
    with pytest.raises(CorruptVersionError, match="written for 'demo' version 1, found as"):
        repo.load("demo", 9)


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", "", ".hidden", "a b", "x\0"])
def test_bad_model_names_are_refused(tiny, repo: ModelRepository, name: str) -> None:
    with pytest.raises(ValueError, match=r"^model name:"):
        repo.publish(name, tiny.model)
    with pytest.raises(ValueError, match=r"^model name:"):
        repo.load(name)
    with pytest.raises(ValueError, match=r"^model name:"):
        repo.versions(name)
    assert not (repo.root.parent / "x").exists()


@pytest.mark.parametrize("version", [0, -1, True, "1", 1.0])
def test_bad_versions_are_refused(tiny, repo: ModelRepository, version) -> None:
    repo.publish("demo", tiny.model)
    with pytest.raises(ValueError, match=r"^version:"):
        repo.load("demo", version)


def test_bad_config_override_writes_nothing(tiny, repo: ModelRepository) -> None:
    with pytest.raises(ValueError, match=r"^max_batch_size:"):
        repo.publish("demo", tiny.model, max_batch_size=0)
    with pytest.raises(TypeError):
        repo.publish("demo", tiny.model, no_such_option=1)
    assert not repo.root.exists() or repo.models() == []


def test_load_to_map_location(tiny, repo: ModelRepository) -> None:
    repo.publish("demo", tiny.model)
    loaded = repo.load("demo", map_location="cpu")
    assert next(loaded.model.parameters()).device == torch.device("cpu")
