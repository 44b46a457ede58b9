"""Save and load a model folder: ``config.json`` + ``model.pt`` (a plain state dict).

Loading never executes code: ``torch.load(weights_only=True)``. A state dict from another config
fails with the names of the tensors that disagree.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from retrieval.config import ModelConfig
from retrieval.model import RetrievalModel
from sharded_tables.sharded import RemoteFetcher

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.pt"


def save_model(model: RetrievalModel, directory: Path) -> Path:
    """Writes the model folder (files are written then renamed, so a crash leaves no half file)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, directory / WEIGHTS_FILE)
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
    model = RetrievalModel(ModelConfig.load(cfg_path), remote=remote, table_device=map_location)
    state = torch.load(weights, map_location=map_location, weights_only=True)
    load_state(model, state)
    return model.to(map_location)


def load_state(model: RetrievalModel, state: dict[str, torch.Tensor]) -> None:
    """``load_state_dict`` with an error that lists every tensor that disagrees."""
    own = model.state_dict()
    problems = [f"missing {k}" for k in own if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in own]
    for k, t in state.items():
        mine = own.get(k)
        if (
            k.startswith("index.")
            or not isinstance(t, torch.Tensor)
            or not isinstance(mine, torch.Tensor)
        ):
            continue  # index buffers are sized by the catalog; the index checks its own dims
        if t.shape != mine.shape or t.dtype != mine.dtype:
            problems.append(
                f"{k}: saved {tuple(t.shape)} {t.dtype}, model has {tuple(mine.shape)} {mine.dtype}"
            )
    if problems:
        raise ValueError("state dict does not fit this model config: " + "; ".join(problems))
    model.load_state_dict(state)
