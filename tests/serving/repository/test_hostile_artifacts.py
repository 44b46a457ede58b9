"""Artifacts that must not load, and names that must not reach the file system.

* weights files that are pickles which would run code when unpickled (``exec``, ``os.system``),
  as torch files and as raw pickles, in every file the repository ``torch.load``s; the same bytes
  in the files that hold no tensors (JSON, ``config.pbtxt``, embedding rows). The manifest is
  rewritten each time, so only the payload is hostile. Each must be refused with an error naming
  the file, and the payload's marker file must never appear;
* model names, versions and shards that would leave the repository, at every entry that takes
  them (the repository's methods, ``ModelHost``, the serve config, KServe's model lookup), and
  symlinks inside a version folder.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from retrieval.artifact import UnsafeArtifactError
from retrieval.tiering import tier_model
from serving.app.config import ConfigError, ServeConfig
from serving.engine.client import InProcessEngine
from serving.engine.host import ModelHost
from serving.engine.runner import ModelRunner
from serving.frontends import kserve
from serving.repository.manifest import CorruptVersionError, verify, write_manifest
from serving.types import ModelNotFoundError, RecResult, RequestError
from sharded_tables.placement import Budgets
from sharded_tables.remote.server_files import read_server_folder
from sharded_tables.specs import DType

NAME = "demo"


# ---- pickles that would run code ---------------------------------------------------------------
class Payload:
    """Unpickling it runs code that creates ``marker`` (through ``exec`` or ``os.system``)."""

    def __init__(self, marker: Path, how: str):
        self.marker, self.how = marker, how

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        if self.how == "system":
            return os.system, (f"touch '{self.marker}'",)
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


PAYLOADS = ["torch.save(object)", "state dict + object", "raw pickle"]


def hostile(kind: str, marker: Path, like: Path) -> bytes:
    """A weights file (``like``: the real one) that runs code when unpickled."""
    buf = io.BytesIO()
    if kind == "torch.save(object)":
        torch.save(Payload(marker, "system"), buf)
    elif kind == "state dict + object":
        state = torch.load(like, weights_only=True)
        state["evil"] = Payload(marker, "exec")
        torch.save(state, buf)
    else:
        return pickle.dumps(Payload(marker, "exec"), protocol=2)
    return buf.getvalue()


def poison(vdir: Path, rel: str, data: bytes) -> None:
    """Replaces one file and rewrites the manifest, so only the payload is hostile."""
    (vdir / rel).write_bytes(data)
    write_manifest(vdir, model=NAME, version=int(vdir.name))
    verify(vdir)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(k, marks=pytest.mark.multiproc) if k == "torch.save(object)" else k
        for k in PAYLOADS
    ],
)  # torch.save(object): its os.system starts a shell
def test_the_payloads_run_code_when_unpickled_plainly(tiny, repo, tmp_path, kind) -> None:
    """So that the refusals below mean something."""
    repo.publish(NAME, tiny.model)
    marker = tmp_path / "ran"
    data = hostile(kind, marker, repo.root / NAME / "1" / "model" / "model.pt")
    if kind == "raw pickle":
        pickle.loads(data)
    else:
        torch.load(io.BytesIO(data), weights_only=False)
    assert marker.exists()


WEIGHTS = {  # what holds tensors: (shards, file, how the repository loads it)
    "model weights": (None, "model/model.pt", lambda r: r.load(NAME)),
    "router weights": (2, "model/model.pt", lambda r: r.load(NAME)),
    "shard weights": (2, "shards/1/index.pt", lambda r: r.load_shard(NAME, 1, 1)),
}


@pytest.mark.parametrize("kind", PAYLOADS)
@pytest.mark.parametrize("target", list(WEIGHTS))
def test_pickle_payloads_are_refused(tiny, repo, tmp_path, monkeypatch, target, kind) -> None:
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # weights_only=True still wins
    shards, rel, load = WEIGHTS[target]
    repo.publish(NAME, tiny.model, shards=shards)
    vdir, marker = repo.root / NAME / "1", tmp_path / "ran"
    poison(vdir, rel, hostile(kind, marker, vdir / rel))
    with pytest.raises(UnsafeArtifactError, match=re.escape(str(vdir / rel))) as err:
        load(repo)
    assert "weights_only" in str(err.value)
    assert not marker.exists()


OTHER_FILES = {  # files that hold no tensors: JSON, protobuf text, raw rows
    "model config": ("model/config.json", lambda r, v: r.load(NAME)),
    "shard map": ("model/shard_map.json", lambda r, v: r.load(NAME)),
    "shard index config": ("shards/0/index.json", lambda r, v: r.load_shard(NAME, 1, 0)),
    # the version's own (the model-level copy is never parsed: test_config_repair.py)
    "config.pbtxt": ("config.pbtxt", lambda r, v: r.load(NAME)),
    "embedding rows": (
        "embeddings/server-0/item.bin",
        lambda r, v: read_server_folder(v / "embeddings/server-0"),
    ),
}


@pytest.mark.parametrize("target", list(OTHER_FILES))
def test_pickle_in_other_files_is_never_unpickled(tiny, repo, tmp_path, target) -> None:
    rel, load = OTHER_FILES[target]
    if target == "embedding rows":  # the tables on an embedding server: rows written as files
        budgets = Budgets(device=0, host=1 << 12, remote_per_server=64 << 20, remote_servers=1)
        model, rows = tier_model(tiny.model, budgets, dtype=DType.FP32)
        repo.publish(NAME, model, remote_rows=rows)
    else:
        repo.publish(NAME, tiny.model, shards=2)
    vdir, marker = repo.root / NAME / "1", tmp_path / "ran"
    poison(vdir, rel, hostile("raw pickle", marker, vdir / rel))
    with pytest.raises(ValueError, match=re.escape(str((vdir / rel).resolve()))):
        load(repo, vdir)
    assert not marker.exists()


def test_host_refuses_a_hostile_version_and_keeps_serving(tiny, repo, tmp_path) -> None:
    repo.publish(NAME, tiny.model)
    host = ModelHost(repo, NAME, poll_s=0, warmup_sizes=(1,))
    host.start()
    assert repo.publish(NAME, tiny.model) == 2
    vdir, marker = repo.root / NAME / "2", tmp_path / "ran"
    poison(vdir, "model/model.pt", hostile("torch.save(object)", marker, vdir / "model/model.pt"))
    assert host.poll_once() is None and host.failed == {2} and host.version == 1
    reqs = [tiny.request(u) for u in range(4)]
    want = ModelRunner(tiny.model, NAME, 1).run(reqs)
    with host.running() as runner:
        got = runner.run(reqs)
    ids = [[r.item_ids for r in rs if isinstance(r, RecResult)] for rs in (got, want)]
    assert len(ids[0]) == len(ids[1]) == len(reqs), (got, want)
    assert all(np.array_equal(g, w) for g, w in zip(*ids, strict=True))
    assert not marker.exists()


# ---- names that leave the repository -----------------------------------------------------------
BAD_NAMES = ["../x", "a/../../b", "/abs", "..", ".", "", "a/b", "x\0", "..\\x", ".staging-x"]
BAD_VERSIONS = ["../1", "-1", -1, 0, "1/../2", "1", 1.5, True]
SERVED = "served"
NAME_ENTRIES = {  # every entry that takes a model name: (repository, name, model)
    "publish": lambda r, n, m: r.publish(n, m),
    "load": lambda r, n, m: r.load(n),
    "load_shard": lambda r, n, m: r.load_shard(n, 1, 0),
    "verified_dir": lambda r, n, m: r.verified_dir(n),
    "version_dir": lambda r, n, m: r.version_dir(n, 1),
    "model_dir": lambda r, n, m: r.model_dir(n),
    "versions": lambda r, n, m: r.versions(n),
    "latest": lambda r, n, m: r.latest(n),
    "config": lambda r, n, m: r.config(n),
    "ModelHost.start": lambda r, n, m: ModelHost(r, n, poll_s=0).start(),
    "ModelHost.poll_once": lambda r, n, m: ModelHost(r, n, poll_s=0).poll_once(),
}
VERSION_ENTRIES = {  # every entry that takes a version: (repository, version)
    "version_dir": lambda r, v: r.version_dir(NAME, v),
    "verified_dir": lambda r, v: r.verified_dir(NAME, v),
    "load": lambda r, v: r.load(NAME, v),
    "load_shard": lambda r, v: r.load_shard(NAME, v, 0),
}


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def published(tiny, repo, tmp_path) -> Any:
    """A sharded NAME and a served unsharded SERVED; yields the serving state (its host), then
    checks that nothing appeared anywhere (nor at ``/abs``, ``/x``)."""
    repo.publish(NAME, tiny.model, shards=2)
    repo.publish(SERVED, tiny.model)
    host = ModelHost(repo, SERVED, poll_s=0, warmup_sizes=(1,))
    host.start()
    before = tree(tmp_path)
    # the engine as a front end reaches it; no request gets as far as the batcher
    yield SimpleNamespace(host=host, engine=InProcessEngine(host, SimpleNamespace(policy=None)))
    assert tree(tmp_path) == before and not Path("/abs").exists() and not Path("/x").exists()


@pytest.mark.parametrize("name", BAD_NAMES)
def test_names_leaving_the_repository_are_refused(tiny, repo, published, name) -> None:
    for entry, call in NAME_ENTRIES.items():
        with pytest.raises(ValueError, match=r"^model name:"):
            call(repo, name, tiny.model)
            pytest.fail(f"{entry} took {name!r}")
    if name:  # "" means the only model / the one served
        with pytest.raises(ConfigError, match=r"^model:"):
            ServeConfig(model_repo=repo.root, model=name).validate()
        with pytest.raises(ModelNotFoundError, match=r"^model:"):
            kserve.resolve(published, name, "")


@pytest.mark.parametrize("version", BAD_VERSIONS)
def test_versions_leaving_the_repository_are_refused(repo, published, version) -> None:
    for entry, call in VERSION_ENTRIES.items():
        with pytest.raises(ValueError, match=r"^version:"):
            call(repo, version)
            pytest.fail(f"{entry} took {version!r}")
    if isinstance(version, str) and not version.isdigit():
        with pytest.raises(RequestError, match=r"^version:"):
            kserve.resolve(published, SERVED, version)


@pytest.mark.parametrize("shard", ["../0", "0", True, 0.5])
def test_shards_that_are_no_number_are_refused(repo, published, shard) -> None:
    with pytest.raises(ValueError, match=r"^shard:"):
        repo.load_shard(NAME, 1, shard)


@pytest.mark.parametrize("link", ["model", "model/model.pt"])
def test_symlinks_out_of_a_version_are_refused(tiny, repo, tmp_path, link) -> None:
    """A version holds plain files: a link could load (unverified) bytes from anywhere."""
    repo.publish(NAME, tiny.model)
    vdir = repo.root / NAME / "1"
    outside = tmp_path / "outside"
    shutil.copytree(vdir / "model", outside)
    if link == "model":
        shutil.rmtree(vdir / link)
        (vdir / link).symlink_to(outside)
    else:
        (vdir / link).unlink()
        (vdir / link).symlink_to(outside / "model.pt")
    write_manifest(vdir, model=NAME, version=1)
    with pytest.raises(CorruptVersionError, match=re.escape(f"{link}: a symlink")):
        repo.load(NAME)
