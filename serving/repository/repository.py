"""A model repository in Triton's layout, with atomic publish, retention and verified loads.

Layout (``root`` is what ``tritonserver --model-repository`` reads)::

    root/<model>/config.pbtxt          Triton ModelConfig (protobuf text): a copy of the latest
                                       version's own config.pbtxt, for Triton (see below)
    root/<model>/.publish.lock         flock'ed by publishers (Triton ignores files here)
    root/<model>/<N>/config.pbtxt      the version's own config, covered by its manifest: the truth
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
next publish removes.

Config and version together: a server must never load a version with another version's config.
Two files cannot change in one rename, so the version
carries its config and the model-level ``config.pbtxt`` is only a derived copy:

1. the staging folder gets the version's ``config.pbtxt`` (listed in its manifest), and the
   model-level file's new content is written, fsynced, to a temp file beside it;
2. ``rename(staging, N)``: the publish (a full disk or a read-only folder failed before this);
3. ``replace(temp, config.pbtxt)``, then the folder is fsynced.

A crash before 2 leaves the old (config, latest version) pair; after 3 the new pair; between 2
and 3 the new version beside the old model-level config, which the next reader repairs:
:meth:`ModelRepository.load` serves the version's own config (so ``ModelHost`` and the batching
policy never see another version's), and :meth:`ModelRepository.repair_config`, which ``load``
calls, rewrites a model-level ``config.pbtxt`` that disagrees with the latest complete version's
own (atomically, under the publish lock; skipped while a publisher holds it, as that one writes
it last). :func:`serving.repository.tritonserver.triton_launch` repairs before Triton starts. A
version published before versions carried a config serves the model-level file.

Example::

    repo = ModelRepository(Path("repo"))
    v = repo.publish("demo", model, keep=3, max_batch_size=32)
    loaded = repo.load("demo")          # verifies checksums first
    ids, scores = loaded.model(batch, 10)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.atomic import atomic_write_bytes, fsync_dir, fsync_tree, temp_path, write_synced
from retrieval.artifact import ShardMap, load_model, load_shard, save_model, save_sharded
from retrieval.index.ivf import IVFIndex
from retrieval.model import RetrievalModel, table_specs
from serving.repository.config import (
    CONFIG_FILE,
    TritonConfig,
    format_config,
    make_config,
    upgrade_config,
)
from serving.repository.manifest import MANIFEST_FILE, CorruptVersionError, verify, write_manifest
from serving.repository.model_folder import (
    LOCK_FILE,
    complete_versions,
    locked,
    numbered,
    own_config,
    parse_own_config,
    read_config_file,
    remove_leftovers,
    retain,
    stage_name,
)
from sharded_tables.export import RemoteRows, write_server_folders
from sharded_tables.planner import PlacementPlan
from sharded_tables.tiered import RemoteFetcher

log = logging.getLogger(__name__)

ARTIFACT_DIR = "model"
"""Where a version keeps :func:`retrieval.artifact.save_model`'s folder."""
SHARDS_DIR = "shards"
"""Where a document-sharded version keeps its shards' index parts (``shards/<s>/``)."""
EMBEDDINGS_DIR = "embeddings"
"""Where a version keeps the rows of its remote tables (``embeddings/server-<i>/``)."""
BACKEND_FILE = "model.py"
"""Triton's default file name for a Python backend model."""
BACKEND_SOURCE = Path(__file__).with_name("triton_python_model.py")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


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
    """The version's own ``config.pbtxt`` (Triton ``ModelConfig``); the model-level one for a
    version published without its own."""
    path: Path
    """The version folder."""
    shard_map: ShardMap | None = None
    """For a document-sharded version: how its catalog is split (``model.index`` is then the
    router's statistics-only index; the shards hold the items)."""
    sequence: int = 0
    """Live updates applied to ``model`` since it was published (its update log's length)."""

    @property
    def config_pb(self) -> TritonConfig:
        return self.config


class ModelRepository:
    """Reads and writes ``root`` (see the module docstring for the layout)."""

    def __init__(self, root: Path | str, device: str | torch.device = "cpu"):
        """``device``: where :meth:`load` puts a model unless told otherwise (a server's
        ``--device``)."""
        self.root = Path(root)
        self.device = device

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
            and ((p / CONFIG_FILE).is_file() or complete_versions(p))
        )

    def versions(self, name: str) -> list[int]:
        """Complete versions (numbered folder with a manifest), ascending; [] for no model."""
        return complete_versions(self.model_dir(name))

    def latest(self, name: str) -> int | None:
        return max(self.versions(name), default=None)

    def config(self, name: str, version: int | None = None) -> TritonConfig:
        """The config ``version`` (default: the latest complete one) serves with: its own
        ``config.pbtxt``, checked against its manifest, else (a version published without one,
        or no version) the model-level file. Errors name the file (and line / field)."""
        v = self.latest(name) if version is None else check_version(version)
        mdir = self.model_dir(name)
        own = None if v is None else own_config(mdir / str(v))
        if own is None:
            return read_config_file(mdir / CONFIG_FILE)
        return parse_own_config(own, mdir / str(v) / CONFIG_FILE)

    def repair_config(self, name: str) -> bool:
        """Makes the model-level ``config.pbtxt`` a copy of the latest complete version's own
        (a publish killed between its version's rename and its config write leaves the old
        one); True when it rewrote it. Atomic, under the publish lock; does nothing while a
        publisher holds the lock (it writes the config last), for a version without its own
        config, or where the file system refuses (logged: readers serve the version's own
        config anyway)."""
        mdir = self.model_dir(name)
        try:
            if self._config_agrees(mdir):
                return False
            with locked(mdir / LOCK_FILE, wait=False) as held:
                if not held or self._config_agrees(mdir):
                    return False
                own = own_config(mdir / str(self.latest(name)))
                assert own is not None  # _config_agrees said so
                atomic_write_bytes(mdir / CONFIG_FILE, own)
        except (OSError, CorruptVersionError) as e:
            log.warning("model %s: cannot repair %s: %s", name, mdir / CONFIG_FILE, e)
            return False
        log.warning(
            "model %s: %s disagreed with version %s's own config (a publish was killed "
            "midway); rewrote it",
            name,
            mdir / CONFIG_FILE,
            self.latest(name),
        )
        return True

    def _config_agrees(self, mdir: Path) -> bool:
        """The model-level config holds the latest version's own (or there is nothing to
        compare with: no version, or one without its own config)."""
        latest = max(complete_versions(mdir), default=None)
        own = None if latest is None else own_config(mdir / str(latest))
        if own is None:
            return True
        try:
            return (mdir / CONFIG_FILE).read_bytes() == own
        except FileNotFoundError:
            return False

    def load(
        self,
        name: str,
        version: int | None = None,
        map_location: str | torch.device | None = None,
        remote: RemoteFetcher | None = None,
    ) -> LoadedModel:
        """Verifies then loads ``version`` (default: the latest complete one); ``remote``: the
        embedding servers of its remote tables, if it has any.

        Raises ``FileNotFoundError`` (no such model or version), :class:`CorruptVersionError`
        (checksums, or a manifest naming another model / version) before reading any weights.
        """
        vdir = self.verified_dir(name, version)
        own = own_config(vdir)  # verified above
        cfg = (
            read_config_file(self.model_dir(name) / CONFIG_FILE)
            if own is None
            else parse_own_config(own, vdir / CONFIG_FILE)
        )
        self.repair_config(name)  # a killed publish's model-level config heals here
        where = self.device if map_location is None else map_location
        model = load_model(vdir / ARTIFACT_DIR, map_location=where, remote=remote)
        model.eval()
        cfg = upgrade_config(cfg, raw_ids=model.id_maps is not None)
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
        remote_rows: RemoteRows | None = None,
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
        :class:`PublishError` and leaves no new version and no staging folder. The version
        carries its own ``config.pbtxt``; the model's is replaced (atomically) just after the
        version's rename, from a temp file written before it (see the module docstring).
        """
        check_name(name)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: must be a positive int, got {keep!r}")
        # refuse bad overrides early; a model with id maps declares the raw id tensors
        raw_ids = model.id_maps is not None
        cfg = make_config(name, model.config, raw_ids=raw_ids, **config_overrides)
        if shards is not None and (isinstance(shards, bool) or shards < 1):
            raise ValueError(f"shards: must be a positive int, got {shards!r}")
        if assignment is not None and shards is None:
            raise ValueError("assignment: give shards (the number of shards) with it")
        mdir = self.model_dir(name)
        version, published, text = 0, False, format_config(cfg).encode("utf-8")
        try:
            mdir.mkdir(parents=True, exist_ok=True)
            with locked(mdir / LOCK_FILE):
                remove_leftovers(mdir)
                # a publish killed after its rename never ran retention: trim first, so at most
                # keep + 1 complete versions exist at any moment, whatever was killed before
                retain(mdir, keep)
                version = max(numbered(mdir), default=0) + 1  # incomplete numbers are skipped too
                stage, pending = mdir / stage_name(), temp_path(mdir / CONFIG_FILE)
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
                    write_synced(stage / CONFIG_FILE, text)  # the version's own: the truth
                    write_manifest(stage, model=name, version=version)
                    fsync_tree(stage)
                    # the model-level copy's bytes, written before the rename so that a full
                    # disk fails here, with nothing published
                    write_synced(pending, text)
                    os.rename(stage, mdir / str(version))  # the publish: one atomic rename
                except BaseException:
                    shutil.rmtree(stage, ignore_errors=True)
                    pending.unlink(missing_ok=True)
                    raise
                published = True
                # killed here, the new version sits beside the old config: readers repair it
                os.replace(pending, mdir / CONFIG_FILE)
                fsync_dir(mdir)
                retain(mdir, keep)
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


# ---- helpers ----------------------------------------------------------------------------------
def _write_embeddings(model: RetrievalModel, remote_rows: RemoteRows, out: Path) -> None:
    """One folder per embedding server the model's table plan uses."""
    if model.config.table_plan is None:
        raise ValueError("remote_rows: the model has no table plan (its tables are not tiered)")
    plan = PlacementPlan.from_dict(model.config.table_plan)
    write_server_folders(plan, table_specs(model.config), remote_rows, out)
