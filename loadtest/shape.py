"""What a valid request of a published model looks like, read from the repository's files alone
(no torch, no model load): the load generator runs beside the server without its weight."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_VERSION = re.compile(r"[1-9][0-9]*")
# a published version's layout (serving/repository/repository.py): a complete version is a
# numbered folder holding manifest.json; the model's config.json is in its model/ folder
_MANIFEST, _ARTIFACT, _CONFIG, _PBTXT = "manifest.json", "model", "config.json", "config.pbtxt"
# a model trained on imported data keeps its raw item ids beside config.json (docs/data.md)
_ITEM_IDS, _RAW_COLUMN = "item_ids.parquet", "raw_id"


@dataclass(frozen=True)
class ModelShape:
    """What a valid request of a published model looks like (from its ``config.json``)."""

    name: str
    version: int
    num_items: int
    """Item ids are ``0 .. num_items - 1``."""
    user_features: dict[str, int]
    """Categorical user feature -> vocabulary size, in request order (F features)."""
    dense_dim: int
    """Dd: dense user features."""
    history_len: int
    """Most recent history items the model reads."""
    item_attributes: dict[str, list[str]] = field(default_factory=dict)
    """Filterable attribute -> its values."""
    raw_item_ids: tuple[str, ...] | None = None
    """A model with id maps: the raw id (as text) of each item id, so requests name their
    history in the user's own ids (``raw_history``); None: a model without maps."""


def _versions(model_dir: Path) -> list[int]:
    if not model_dir.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in model_dir.iterdir()
        if _VERSION.fullmatch(p.name) and (p / _MANIFEST).is_file()
    )


def _models(repo: Path) -> list[str]:
    if not repo.is_dir():
        return []
    return sorted(
        p.name
        for p in repo.iterdir()
        if p.is_dir()
        and _NAME.fullmatch(p.name)
        and not p.name.startswith(".")
        and ((p / _PBTXT).is_file() or _versions(p))
    )


def read_model_shape(repo: Path, model: str | None = None) -> ModelShape:
    """The latest published version of ``model`` (default: the repository's only model);
    ``ValueError`` naming ``--model-repo`` / ``--model`` when there is none."""
    found = _models(repo)
    if not found:
        raise ValueError(f"--model-repo: {repo} holds no published model")
    if model and model not in found:
        raise ValueError(f"--model: no model {model!r} in {repo} (found: {', '.join(found)})")
    if not model and len(found) != 1:
        raise ValueError(f"--model: {repo} holds models {', '.join(found)}; name one")
    name = model or found[0]
    versions = _versions(repo / name)
    if not versions:
        raise ValueError(f"--model: {name!r} has no published version in {repo / name}")
    path = repo / name / str(versions[-1]) / _ARTIFACT / _CONFIG
    try:
        cfg = json.loads(path.read_text())
        return ModelShape(
            name=name,
            version=versions[-1],
            num_items=int(cfg["num_items"]),
            user_features={str(k): int(v) for k, v in cfg["user_features"].items()},
            dense_dim=int(cfg["dense_dim"]),
            history_len=int(cfg.get("history_len", 50)),
            item_attributes={str(a): list(map(str, v)) for a, v in cfg["item_attributes"].items()},
            raw_item_ids=_raw_item_ids(path.parent / _ITEM_IDS),
        )
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"--model-repo: cannot read {path}: {e!r}") from None


def _raw_item_ids(path: Path) -> tuple[str, ...] | None:
    """The item id map's raw ids as text (row ``i``: item ``i``); None when there is none."""
    if not path.is_file():
        return None
    import pyarrow as pa  # only for a model with id maps
    import pyarrow.parquet as pq

    try:
        column = pq.read_table(path, columns=[_RAW_COLUMN]).column(0)
    except (pa.ArrowException, KeyError) as e:
        raise ValueError(f"--model-repo: cannot read {path}: {e}") from None
    return tuple(column.cast(pa.string()).to_pylist())
