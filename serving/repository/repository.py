"""A model repository in Triton's layout, with atomic publish, retention and verified loads.

Layout (``root`` is what ``tritonserver --model-repository`` reads)::

    root/<model>/config.pbtxt          Triton ModelConfig (protobuf text), rewritten per publish
    root/<model>/.publish.lock         flock'ed by publishers (Triton ignores files here)
    root/<model>/<N>/model.py          the Triton Python backend (triton_python_model.py)
    root/<model>/<N>/model/            our artifact: config.json + model.pt (retrieval.artifact)
    root/<model>/<N>/shards/<s>/       document-sharded versions: shard s's part of the index
                                       (then model/ is the router part, with shard_map.json)
    root/<model>/<N>/embeddings/server-<i>/  rows of remote tables, for embedding server i
    root/<model>/<N>/manifest.json     sizes and SHA-256 of every file above
    root/<model>/.staging-<host>-<pid>-<uuid>/  a publish in progress: not a number, so
                                       Triton and :meth:`ModelRepository.versions` ignore it

A version is *complete* when its folder name is a number and it holds ``manifest.json``; the
folder appears in one ``rename`` after every file was written and fsynced, so a reader never sees
half a version. A publish that fails (disk full, read-only folder) raises :class:`PublishError`
and leaves nothing; one killed midway leaves a staging folder (or a config temp file), which the
next publish removes. Example::

    repo = ModelRepository(Path("repo"))
    v = repo.publish("demo", model, keep=3, max_batch_size=32)
    loaded = repo.load("demo")          # verifies checksums first
    ids, scores = loaded.model(batch, 10)
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.atomic import fsync_dir, fsync_tree, temp_target
from retrieval.artifact import ShardMap, load_model, load_shard, save_model, save_sharded
from retrieval.index.ivf import IVFIndex
from retrieval.model import RetrievalModel, table_specs
from serving.repository.config import (
    CONFIG_FILE,
    TritonConfig,
    make_config,
    read_config,
    write_config,
)
from serving.repository.manifest import MANIFEST_FILE, CorruptVersionError, verify, write_manifest
from sharded_tables.export import write_server_folders
from sharded_tables.planner import PlacementPlan
from sharded_tables.tiered import RemoteFetcher

ARTIFACT_DIR = "model"
"""Where a version keeps :func:`retrieval.artifact.save_model`'s folder."""
SHARDS_DIR = "shards"
"""Where a document-sharded version keeps its shards' index parts (``shards/<s>/``)."""
EMBEDDINGS_DIR = "embeddings"
"""Where a version keeps the rows of its remote tables (``embeddings/server-<i>/``)."""
BACKEND_FILE = "model.py"
"""Triton's default file name for a Python backend model."""
BACKEND_SOURCE = Path(__file__).with_name("triton_python_model.py")
LOCK_FILE = ".publish.lock"
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".deleted-"
STALE_STAGING_S = 3600.0
"""A staging folder older than this is a crashed publish; the next publish removes it (one
staged by a process of this host that no longer runs is removed at once)."""

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_VERSION = re.compile(r"[1-9][0-9]*")


class PublishError(OSError):
    """A publish the file system refused (disk full, read-only folder, ...); the message names
    the model, the version and the folder, and says whether the version was published (only a
    failure after the rename leaves it published). ``errno`` is the cause's."""


def check_name(name: str) -> str:
    """A model name that is one safe path component; ``ValueError`` otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.startswith("."):
        raise ValueError(f"model name: {name!r} must match [A-Za-z0-9_.-]+ and not start with '.'")
    return name


def check_version(version: int) -> int:
    """A positive int version; ``ValueError`` otherwise."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"version: {version!r} must be a positive int")
    return version


@dataclass(frozen=True)
class LoadedModel:
    """One loaded, verified version."""

    name: str
    version: int
    model: RetrievalModel
    """In eval mode."""
    config: TritonConfig
    """The model's ``config.pbtxt`` (Triton ``ModelConfig``)."""
    path: Path
    """The version folder."""
    shard_map: ShardMap | None = None
    """For a document-sharded version: how its catalog is split (``model.index`` is then the
    router's statistics-only index; the shards hold the items)."""

    @property
    def config_pb(self) -> TritonConfig:
        return self.config


class ModelRepository:
    """Reads and writes ``root`` (see the module docstring for the layout)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    # ---- paths --------------------------------------------------------------------------------
    def model_dir(self, name: str) -> Path:
        return self.root / check_name(name)

    def version_dir(self, name: str, version: int) -> Path:
        return self.model_dir(name) / str(check_version(version))

    # ---- reading ------------------------------------------------------------------------------
    def models(self) -> list[str]:
        """Model folders that hold a ``config.pbtxt`` or a complete version, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.is_dir()
            and _NAME.fullmatch(p.name)
            and not p.name.startswith(".")
            and ((p / CONFIG_FILE).is_file() or _complete_versions(p))
        )

    def versions(self, name: str) -> list[int]:
        """Complete versions (numbered folder with a manifest), ascending; [] for no model."""
        return _complete_versions(self.model_dir(name))

    def latest(self, name: str) -> int | None:
        return max(self.versions(name), default=None)

    def config(self, name: str) -> TritonConfig:
        """The model's ``config.pbtxt``; errors name the file (and line / field when malformed)."""
        return _read_config(self.model_dir(name) / CONFIG_FILE)

    def load(
        self,
        name: str,
        version: int | None = None,
        map_location: str | torch.device = "cpu",
        remote: RemoteFetcher | None = None,
    ) -> LoadedModel:
        """Verifies then loads ``version`` (default: the latest complete one); ``remote``: the
        embedding servers of its remote tables, if it has any.

        Raises ``FileNotFoundError`` (no such model or version), :class:`CorruptVersionError`
        (checksums, or a manifest naming another model / version) before reading any weights.
        """
        vdir = self.verified_dir(name, version)
        cfg = _read_config(self.model_dir(name) / CONFIG_FILE)
        model = load_model(vdir / ARTIFACT_DIR, map_location=map_location, remote=remote)
        model.eval()
        return LoadedModel(
            name, int(vdir.name), model, cfg, vdir, ShardMap.read(vdir / ARTIFACT_DIR)
        )

    def load_shard(
        self, name: str, version: int, shard: int, map_location: str | torch.device = "cpu"
    ) -> tuple[IVFIndex, ShardMap]:
        """Verifies ``version``, then loads document shard ``shard``'s part of its index."""
        if isinstance(shard, bool) or not isinstance(shard, int):
            raise ValueError(f"shard: {shard!r} must be an int")
        vdir = self.verified_dir(name, version)
        smap = ShardMap.read(vdir / ARTIFACT_DIR)
        if smap is None:
            raise FileNotFoundError(f"model {name!r} version {version} is not document-sharded")
        if not 0 <= shard < smap.num_shards:
            raise FileNotFoundError(
                f"model {name!r} version {version} has shards 0..{smap.num_shards - 1}, not {shard}"
            )
        return load_shard(vdir / SHARDS_DIR / str(shard), map_location), smap

    def verified_dir(self, name: str, version: int | None = None) -> Path:
        """The folder of ``version`` (default: latest) after its checksums verified."""
        v = self.latest(name) if version is None else check_version(version)
        mdir = self.model_dir(name)
        if v is None:
            raise FileNotFoundError(f"model {name!r}: no published version in {mdir}")
        vdir = mdir / str(v)
        if not vdir.is_dir():
            raise FileNotFoundError(f"model {name!r}: version {v} not found ({vdir})")
        manifest = verify(vdir)
        if manifest.model != name or manifest.version != v:
            raise CorruptVersionError(
                f"{vdir / MANIFEST_FILE}: written for {manifest.model!r} version "
                f"{manifest.version}, found as {name!r} version {v}"
            )
        return vdir

    # ---- writing ------------------------------------------------------------------------------
    def publish(
        self,
        name: str,
        model: RetrievalModel,
        *,
        keep: int = 3,
        shards: int | None = None,
        assignment: torch.Tensor | None = None,
        remote_rows: dict[str, torch.Tensor] | None = None,
        **config_overrides: Any,
    ) -> int:
        """Writes ``model`` as the next version of ``name``; returns the version number.

        ``shards``: split the catalog into that many document shards (by a stable hash of the
        item id, or by ``assignment [num_items]``: each item id's shard). ``remote_rows``: the
        packed rows of the plan's remote tables (what ``retrieval.tiering.tier_model``
        returns), written as one folder per embedding server.

        ``config_overrides`` go to :func:`serving.repository.config.make_config` (``max_batch_size``,
        ``max_queue_delay_us``, ``preferred_batch_sizes``, ``max_queue_size``,
        ``versions_latest``, ``backend``, ``parameters``). Publishers of one model take turns
        (an exclusive ``flock``); after the new version is in place, all but the newest ``keep``
        complete versions are removed, oldest first.

        A write the file system refuses (disk full, read-only folder) raises
        :class:`PublishError` and leaves no new version and no staging folder. The model's
        ``config.pbtxt`` is replaced (atomically) just before the version's rename.
        """
        check_name(name)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: must be a positive int, got {keep!r}")
        cfg = make_config(name, model.config, **config_overrides)  # refuse bad overrides early
        if shards is not None and (isinstance(shards, bool) or shards < 1):
            raise ValueError(f"shards: must be a positive int, got {shards!r}")
        if assignment is not None and shards is None:
            raise ValueError("assignment: give shards (the number of shards) with it")
        mdir = self.model_dir(name)
        version, published = 0, False
        try:
            mdir.mkdir(parents=True, exist_ok=True)
            with _locked(mdir / LOCK_FILE):
                _remove_leftovers(mdir)
                version = max(_numbered(mdir), default=0) + 1  # incomplete numbers are skipped too
                stage = mdir / _stage_name()
                stage.mkdir()
                try:
                    if shards is None:
                        save_model(model, stage / ARTIFACT_DIR)
                    else:
                        save_sharded(
                            model, stage / ARTIFACT_DIR, stage / SHARDS_DIR, shards, assignment
                        )
                    if remote_rows is not None:
                        _write_embeddings(model, remote_rows, stage / EMBEDDINGS_DIR)
                    shutil.copyfile(BACKEND_SOURCE, stage / BACKEND_FILE)
                    write_manifest(stage, model=name, version=version)
                    fsync_tree(stage)
                    # config before the version: a version never shows without its config, and a
                    # failed config write (disk full) leaves nothing published
                    write_config(mdir / CONFIG_FILE, cfg)
                    os.rename(stage, mdir / str(version))  # the publish: one atomic rename
                except BaseException:
                    shutil.rmtree(stage, ignore_errors=True)
                    raise
                published = True
                fsync_dir(mdir)
                _retain(mdir, keep)
        except OSError as e:
            what = f"version {version}" if version else "a new version"
            why = (e.strerror or str(e)) + (f": {e.filename!s}" if e.filename else "")
            msg = (
                f"model {name!r}: {what} is published in {mdir}, but finishing the publish "
                f"failed: {why}"
                if published
                else f"model {name!r}: publishing {what} into {mdir} failed, nothing was "
                f"published: {why}"
            )
            raise (PublishError(e.errno, msg) if e.errno else PublishError(msg)) from e
        return version


# ---- helpers (the caller holds the model's lock where it writes) --------------------------------
def _write_embeddings(
    model: RetrievalModel, remote_rows: dict[str, torch.Tensor], out: Path
) -> None:
    """One folder per embedding server the model's table plan uses."""
    if model.config.table_plan is None:
        raise ValueError("remote_rows: the model has no table plan (its tables are not tiered)")
    plan = PlacementPlan.from_dict(model.config.table_plan)
    write_server_folders(plan, table_specs(model.config), remote_rows, out)


def _numbered(mdir: Path) -> list[int]:
    """Every numbered folder, complete or not."""
    if not mdir.is_dir():
        return []
    return [int(p.name) for p in mdir.iterdir() if _VERSION.fullmatch(p.name) and p.is_dir()]


def _complete_versions(mdir: Path) -> list[int]:
    return sorted(v for v in _numbered(mdir) if (mdir / str(v) / MANIFEST_FILE).is_file())


def _read_config(path: Path) -> TritonConfig:
    """:func:`read_config`, with a file that is no text refused naming it too."""
    try:
        return read_config(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (per open file, so threads of one process exclude
    each other too)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _stage_name() -> str:
    """Names its publisher, so that the next publish can tell when that one is gone."""
    return f"{STAGING_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"


def _abandoned(stage: Path, now: float) -> bool:
    """A staging folder whose publisher is gone: staged by a process of this host that no longer
    runs, or older than :data:`STALE_STAGING_S` (another host's, or an unknown name)."""
    host_pid = stage.name[len(STAGING_PREFIX) :].rsplit("-", 2)[:-1]
    if len(host_pid) == 2 and host_pid[0] == socket.gethostname() and host_pid[1].isdigit():
        try:
            os.kill(int(host_pid[1]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it runs, as another user
    return now - stage.stat().st_mtime > STALE_STAGING_S


def _remove_leftovers(mdir: Path) -> None:
    """Removes deleted versions not yet gone, staging folders of crashed publishes and the temp
    files of interrupted config writes (only publish writes the config, under the lock held)."""
    now = time.time()
    for p in mdir.iterdir():
        if p.name.startswith(TRASH_PREFIX) or (
            p.name.startswith(STAGING_PREFIX) and _abandoned(p, now)
        ):
            shutil.rmtree(p, ignore_errors=True)
        elif temp_target(p.name) == CONFIG_FILE:  # ``write_config``'s, killed midway
            p.unlink(missing_ok=True)


def _retain(mdir: Path, keep: int) -> None:
    """Removes all but the newest ``keep`` complete versions; each disappears in one rename."""
    for v in _complete_versions(mdir)[:-keep]:
        trash = mdir / f"{TRASH_PREFIX}{v}-{uuid.uuid4().hex}"
        os.rename(mdir / str(v), trash)
        fsync_dir(mdir)
        shutil.rmtree(trash, ignore_errors=True)
