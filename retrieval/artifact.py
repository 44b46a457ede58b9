"""Save and load a model folder: ``config.json`` + ``model.pt`` (a plain state dict), and, for a
model trained on imported data, its id maps (``user_ids.parquet``, ``item_ids.parquet``:
``retrieval/data/id_map.py``), so that the model answers in the user's own ids.

A document-sharded model is saved as a router folder (the model with a statistics-only index,
plus ``shard_map.json``) and one folder per shard (``index.json`` + ``index.pt``: its part of
the index; ``rows.pt``: where its rows were in the unsharded index), with :func:`save_sharded`;
see ``retrieval/index/split.py``. :func:`load_whole_model` puts the parts back together into one
all-local model (offline batch scoring): the shards' parts merged into the unsharded index
(:func:`~retrieval.index.split.merge_shards`), remote tables read from the embedding servers'
folders into this process.

Loading never executes code: ``torch.load(weights_only=True)``; a weights file that is a pickle
of anything but tensors and plain containers is refused (:class:`UnsafeArtifactError`, naming the
file). A state dict from another config fails with the names of the tensors that disagree. A
failed write (disk full) raises the ``OSError`` of the file it was writing.
"""

from __future__ import annotations

import copy
import json
import pickle
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from common.atomic import atomic_writer
from retrieval.config import ModelConfig
from retrieval.data.id_map import IdMaps
from retrieval.format import load_config, migrate, version_of, with_format
from retrieval.index.compaction import fold
from retrieval.index.executor import backend_for
from retrieval.index.format import EXTRA
from retrieval.index.format import migrate as migrate_index
from retrieval.index.format import version_of as index_version
from retrieval.index.ivf import IVFConfig, IVFIndex
from retrieval.index.split import merge_shards, shard_of, shard_rows, split_index
from retrieval.live_updates import with_index
from retrieval.model import RetrievalModel
from sharded_tables.planner import PlacementPlan
from sharded_tables.specs import Tier
from sharded_tables.tiered import RemoteFetcher

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.pt"
SHARD_MAP_FILE = "shard_map.json"
SHARD_INDEX_FILE = "index.pt"
SHARD_META_FILE = "index.json"
SHARD_ROWS_FILE = "rows.pt"


class UnsafeArtifactError(ValueError):
    """A weights file that is not plain tensors: unpickling it would run code, so it is refused."""


def save_model(model: RetrievalModel, directory: Path) -> Path:
    """Writes the model folder (the weights atomically, so a crash leaves no half file). A model
    with live updates saves what it serves: its fresh segment folded into the main lists (the
    segment itself is no buffer: ``retrieval/index/fresh.py``)."""
    directory.mkdir(parents=True, exist_ok=True)
    if model.index.live is not None and model.index.live.size:
        model = with_index(model, fold(model.index))
    save_tensors(with_format(model.state_dict()), directory / WEIGHTS_FILE)
    if model.id_maps is not None:
        model.id_maps.write(directory)
    model.config.save(directory / CONFIG_FILE)
    return directory


def load_model(
    directory: Path, map_location: str | torch.device = "cpu", remote: RemoteFetcher | None = None
) -> RetrievalModel:
    """Reads a folder written by :func:`save_model`; ``remote``: the embedding servers of the
    plan's remote tables (when the config has a table plan with remote tables)."""
    cfg_path, weights = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for p in (cfg_path, weights):
        if not p.is_file():
            raise FileNotFoundError(f"model folder {directory}: missing {p.name}")
    cfg = load_config(cfg_path)
    model = RetrievalModel(cfg, remote=remote, table_device=map_location)
    load_state(model, load_tensors(weights, map_location))
    model.id_maps = read_id_maps(directory, cfg)
    model = model.to(map_location)
    served_on(model.index, map_location)
    return model


def served_on(index: IVFIndex, device: str | torch.device) -> IVFIndex:
    """``index`` searching with the backend of ``device`` (``executor.backend_for``): the one
    place every load for serving or scoring (``serve model / router / shard``, ``score``)
    chooses it."""
    index.executor.backend = backend_for(device)
    return index


def read_id_maps(directory: Path, cfg: ModelConfig) -> IdMaps | None:
    """The model folder's id maps (None: the model knows dense ids only); ``ValueError`` naming
    the folder when one file is missing or the item map does not fit the catalog."""
    try:
        maps = IdMaps.read(directory)
    except ValueError as e:
        raise ValueError(f"model folder {directory}: {e}") from None
    if maps is not None and len(maps.items) != cfg.num_items:
        raise ValueError(
            f"model folder {directory}: the item id map has {len(maps.items)} ids, the model "
            f"{cfg.num_items} items"
        )
    return maps


def save_tensors(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` to ``path`` atomically and durably (``common.atomic``), through a Python
    file: a failed write (disk full, read-only) raises the ``OSError`` naming ``path``, where
    torch's own file writer raises a bare RuntimeError."""
    try:
        with atomic_writer(path) as fh:
            torch.save(state, fh)
    except RuntimeError as e:
        cause = e.__context__  # torch's zip writer fails again in its __exit__, over the OSError
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from e
        raise


def load_tensors(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(weights_only=True)``; :class:`UnsafeArtifactError` naming ``path`` when the
    file holds anything else (unpickling it could run code)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL [\w.]+", str(e))
        asks = f" (it asks for {found.group(0)})" if found else ""
        raise UnsafeArtifactError(
            f"{path}: refused: not a file of plain tensors{asks}; weights are loaded with "
            "weights_only=True, so that loading never runs code"
        ) from None


def read_json(path: Path) -> Any:
    """A JSON file's value; ``ValueError`` naming ``path`` when it is not UTF-8 JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def load_state(model: RetrievalModel, state: dict[str, Any]) -> None:
    """``load_state_dict`` of a saved state of any format (older ones migrated first:
    ``retrieval/format.py``) with an error that lists every tensor that disagrees."""
    state = migrate(state, version_of(state, "model.pt"))
    own = model.state_dict()
    problems = [f"missing {k}" for k in own if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in own]
    for k, t in state.items():
        mine = own.get(k)
        if (
            k.startswith(("index.", "seen_store."))
            or not isinstance(t, torch.Tensor)
            or not isinstance(mine, torch.Tensor)
        ):
            continue  # sized by the catalog / the users; the index checks its own dims
        if t.shape != mine.shape or t.dtype != mine.dtype:
            problems.append(
                f"{k}: saved {tuple(t.shape)} {t.dtype}, model has {tuple(mine.shape)} {mine.dtype}"
            )
    if problems:
        raise ValueError("state dict does not fit this model config: " + "; ".join(problems))
    model.load_state_dict(state)


# ---- document shards ------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardMap:
    """How a model's catalog is split (``shard_map.json`` in the router folder)."""

    num_shards: int
    split: str
    """"hash" (``retrieval.index.split.shard_of`` of the item id) or "assignment" (given)."""
    items_per_shard: tuple[int, ...]
    ntotal: int

    @classmethod
    def read(cls, directory: Path) -> ShardMap | None:
        """The folder's shard map, or None for an unsharded model folder."""
        path = directory / SHARD_MAP_FILE
        if not path.is_file():
            return None
        d = read_json(path)
        return cls(d["num_shards"], d["split"], tuple(d["items_per_shard"]), d["ntotal"])


def save_sharded(
    model: RetrievalModel,
    router_dir: Path,
    shards_dir: Path,
    num_shards: int,
    assignment: torch.Tensor | None = None,
) -> ShardMap:
    """Splits the model's index into ``num_shards`` document shards and saves them.

    ``router_dir``: the model with a statistics-only index + ``shard_map.json``;
    ``shards_dir/<s>/``: shard ``s``'s index part. ``assignment [N] int64`` gives each item's
    shard by item id (``assignment[item_id]``); default: a stable hash of the id. Refuses a map
    that leaves an item without a shard or gives one two.
    """
    index = model.index
    if index.ntotal == 0 or index.item_ids.shape[0] != index.ntotal:
        raise ValueError("save_sharded: the model has no built, unsharded index to split")
    if assignment is None:
        rows_shard, split = shard_of(index.item_ids, num_shards), "hash"
    else:
        assignment = torch.as_tensor(assignment, dtype=torch.int64).cpu()
        if assignment.dim() != 1 or assignment.shape[0] <= int(index.item_ids.max()):
            raise ValueError(
                f"shard assignment: expected one shard per item id ([{model.config.num_items}]), "
                f"got {tuple(assignment.shape)}"
            )
        rows_shard, split = assignment[index.item_ids.cpu()], "assignment"
    stats, parts = split_index(index, rows_shard, num_shards)
    router = copy.copy(model)  # shares towers and tables; only the index differs
    router._modules = dict(model._modules)
    router._modules["index"] = stats
    save_model(router, router_dir)
    for s, (part, rows) in enumerate(zip(parts, shard_rows(rows_shard, num_shards), strict=True)):
        save_shard(part, shards_dir / str(s))
        save_tensors({"rows": rows}, shards_dir / str(s) / SHARD_ROWS_FILE)
    smap = ShardMap(num_shards, split, tuple(p.ntotal for p in parts), index.ntotal)
    (router_dir / SHARD_MAP_FILE).write_text(json.dumps(asdict(smap), indent=2))
    return smap


def save_shard(index: IVFIndex, directory: Path) -> None:
    """One shard's index: ``index.json`` (how to build the module) + ``index.pt`` (buffers)."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = index.get_extra_state()  # format, config, stats, dim, attribute values
    meta.pop("value_lists", None)  # tensors: index.pt holds them (the state's extra state)
    save_tensors(index.state_dict(), directory / SHARD_INDEX_FILE)
    (directory / SHARD_META_FILE).write_text(json.dumps(meta, indent=2))


def load_shard(directory: Path, map_location: str | torch.device = "cpu") -> IVFIndex:
    """Reads a folder written by :func:`save_shard` (no code runs: ``weights_only``)."""
    meta_path, weights = directory / SHARD_META_FILE, directory / SHARD_INDEX_FILE
    for p in (meta_path, weights):
        if not p.is_file():
            raise FileNotFoundError(f"shard folder {directory}: missing {p.name}")
    saved = read_json(meta_path)
    meta = migrate_index({EXTRA: saved}, index_version(saved))[EXTRA]
    config = IVFConfig.from_dict(meta["config"], where=str(meta_path), prefix="config.")
    index = IVFIndex(
        config, meta["dim"], meta["attribute_values"], hashed_digits=meta.get("hashed_digits", {})
    )
    index.load_state_dict(load_tensors(weights, map_location))
    return served_on(index.to(map_location).eval(), map_location)


def load_whole_model(
    directory: Path,
    shards_dir: Path | None = None,
    embeddings_dir: Path | None = None,
    map_location: str | torch.device = "cpu",
) -> RetrievalModel:
    """One all-local model from a published version's parts, answering as the served version.

    ``directory``: the model folder (:func:`save_model`, or the router part of
    :func:`save_sharded`); ``shards_dir``: for a document-sharded model, the folder of its shards
    (``<shards_dir>/<s>/``): their parts are merged into the unsharded index, in its original
    order (see :func:`~retrieval.index.split.merge_shards`); ``embeddings_dir``: for a plan with
    remote tables, the folder of the embedding servers' folders (``server-<i>/``): their rows are
    read into this process and looked up as the servers would (same bytes, same numbers).

    Errors name the folder that is missing or does not fit.
    """
    remote = None
    if embeddings_dir is not None:
        from sharded_tables.export import read_server_folders

        remote = read_server_folders(embeddings_dir)
    model = load_model(directory, map_location, remote=remote)
    needed = remote_tables(model.config)
    missing = sorted(needed - (remote.tables() if remote is not None else set()))
    if missing:
        where = embeddings_dir or "no embeddings folder given"
        raise FileNotFoundError(
            f"model folder {directory}: remote tables {missing} have no rows ({where}); pass "
            "the version's embedding-server folders"
        )
    smap = ShardMap.read(directory)
    if smap is not None:
        if shards_dir is None:
            raise FileNotFoundError(
                f"model folder {directory} is the router part of {smap.num_shards} document "
                "shards; pass the version's shards folder"
            )
        folders = [shards_dir / str(s) for s in range(smap.num_shards)]
        parts = [load_shard(f) for f in folders]
        rows = _shard_rows(directory, [f / SHARD_ROWS_FILE for f in folders])
        try:
            model.index = merge_shards(parts, model.index.cpu(), rows).to(map_location)
        except ValueError as e:
            raise ValueError(f"{shards_dir}: {e}") from None
        served_on(model.index, map_location)
    return model.eval()


def _shard_rows(directory: Path, paths: list[Path]) -> list[torch.Tensor] | None:
    """Each shard's ``rows.pt``; None for a router folder of format 0 published before them
    (its shards' lists in item-id order: ``merge_shards``). A later folder without one is
    incomplete: ``FileNotFoundError`` naming the file."""
    missing = [p for p in paths if not p.is_file()]
    if not missing:
        return [_rows_of(p) for p in paths]
    config = read_json(directory / CONFIG_FILE)
    if len(missing) == len(paths) and version_of(config, str(directory / CONFIG_FILE)) == 0:
        return None
    raise FileNotFoundError(f"{missing[0]}: missing (the shard's rows in the unsharded index)")


def _rows_of(path: Path) -> torch.Tensor:
    """A shard's ``rows.pt``: its rows in the unsharded index, ``int64 [n_s]``."""
    saved = load_tensors(path)
    rows = saved.get("rows") if isinstance(saved, dict) else None
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError(f"{path}: expected {{'rows': int64 [n]}}")
    return rows


def remote_tables(cfg: ModelConfig) -> set[str]:
    """The tables the config's plan puts on embedding servers."""
    if cfg.table_plan is None:
        return set()
    plan = PlacementPlan.from_dict(cfg.table_plan)
    return {p.table for p in plan.tables if p.tier is Tier.REMOTE}
