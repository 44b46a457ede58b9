"""A model folder's saved format: a version in ``config.json`` and in ``model.pt``, and
:func:`migrate`, one step per earlier version, that brings an older folder's config and weights
to this format before they load (a version published long ago keeps loading, and answers as it
did). The index inside carries its own version (``retrieval/index/format.py``).

Versions:

- 0: no version (every folder saved up to this format). ``config.json``'s index config held what
  the build measured (now the index's statistics, in ``model.pt``); a config written before
  ``recent_len`` had no such tower (0); an index config before ``probe`` / ``assign`` probed
  by "ip" over lists assigned by L2; a document-sharded version published before ``rows.pt``
  merges its shards' lists in item-id order (``artifact._shard_rows``).
- 1: ``format`` in ``config.json`` and in ``model.pt``.

``tests/retrieval/test_format.py`` loads a fixture of each through this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrieval.config import MODEL_FORMAT, ModelConfig
from retrieval.index.format import MEASURED, Step, run_steps

if TYPE_CHECKING:
    import torch

FORMAT_KEY = "format"
"""The key of the version in ``config.json`` and in ``model.pt``'s state dict."""
INDEX_PREFIX = "index."


def version_of(saved: dict[str, Any], what: str) -> int:
    """The format a saved config or state dict declares (0: none)."""
    version = saved.get(FORMAT_KEY, 0)
    if type(version) is not int or version < 0:
        raise ValueError(f"{what}: format must be an int >= 0, got {version!r}")
    return version


def load_config(path: Path) -> ModelConfig:
    """A saved ``config.json`` of any format (older ones migrated); errors name the file and
    the field."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return read_config(saved, where=str(path))


def read_config(saved: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """A ``config.json``'s value (any format) -> :class:`ModelConfig`; ``ConfigError`` naming
    ``where`` and the field."""
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(saved).__name__}")
    config = migrate_config(saved, version_of(saved, where))
    config.pop(FORMAT_KEY, None)
    return ModelConfig.from_dict(config, where=where)


def migrate_config(saved: dict[str, Any], version: int) -> dict[str, Any]:
    """A ``config.json`` of format ``version`` -> this format's (a copy)."""
    return run_steps(saved, version, CONFIG_STEPS, MODEL_FORMAT, "config.json")


def migrate(state: dict[str, Any], version: int) -> dict[str, Any]:
    """``model.pt``'s state dict of format ``version`` -> this format's (a copy, the tensors
    shared), without the format entry: what ``load_state_dict`` takes."""
    out = run_steps(state, version, STATE_STEPS, MODEL_FORMAT, "model.pt")
    out.pop(FORMAT_KEY, None)
    return _index_migrated(out)


def with_format(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state dict ``model.pt`` holds: ``state`` and this format."""
    return {FORMAT_KEY: MODEL_FORMAT, **state}


# ---- the steps ----------------------------------------------------------------------------
def _config_from_unversioned(saved: dict[str, Any]) -> dict[str, Any]:
    """Version 0 -> 1 of ``config.json``."""
    out = dict(saved)
    out.setdefault("recent_len", 0)  # written before the field: those towers had none
    index = dict(out.get("index", {}))
    for key in MEASURED:  # the build's measurements: the index's statistics hold them
        index.pop(key, None)
    if index:  # written before the options: probed by inner product, lists by nearest centroid
        index.setdefault("probe", "ip")
        index.setdefault("assign", "l2")
    out["index"], out[FORMAT_KEY] = index, 1
    return out


def _state_from_unversioned(state: dict[str, Any]) -> dict[str, Any]:
    """Version 0 -> 1 of ``model.pt``: a format entry (the index's entries carry their own
    version: :func:`migrate` brings them to this one whatever the model's)."""
    return {**state, FORMAT_KEY: 1}


def _index_migrated(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the index's entries brought to this index format by its own steps
    (before ``load_state`` checks names, so that buffers it added later are there)."""
    from retrieval.index.format import EXTRA
    from retrieval.index.format import migrate as migrate_index
    from retrieval.index.format import version_of as index_version

    out = dict(state)
    extra = out.get(INDEX_PREFIX + EXTRA)
    if isinstance(extra, dict):
        mine = {
            k[len(INDEX_PREFIX) :]: v
            for k, v in out.items()
            if k.startswith(INDEX_PREFIX) and "." not in k[len(INDEX_PREFIX) :]
        }
        for key, value in migrate_index(mine, index_version(extra)).items():
            out[INDEX_PREFIX + key] = value
    return out


CONFIG_STEPS: dict[int, Step] = {0: _config_from_unversioned}
STATE_STEPS: dict[int, Step] = {0: _state_from_unversioned}
