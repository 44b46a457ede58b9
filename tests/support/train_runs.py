"""`recserve train` runs for the multi-process tests: a small synthetic config (seconds a run)
and the command lines of one process and of a torchrun job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

CONFIG = """
[data]
source = "synthetic"
num_users = 400
num_items = 600
[model]
embedding_dim = 16
hidden = [32]
out_dim = 16
history_len = 10
{model}
[train]
epochs = {epochs}
batch_size = 128
micro_batches = {micro}
random_negatives = 16
progress = false
{train}
[evaluate]
k = 50
{extra}
"""


def train_cmd(cfg: Path, out: Path, nproc: int, *flags: str) -> list[str]:
    """``recserve train`` as one process or as a torchrun job of ``nproc`` ranks."""
    cmd = ["-m", "recserve", "train", "--config", str(cfg), "--out", str(out), *flags]
    if nproc > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
    return [sys.executable, *cmd]


def write_config(
    tmp: Path,
    name: str,
    micro: int = 1,
    train: str = "",
    extra: str = "",
    model: str = "",
    epochs: int = 2,
) -> Path:
    """CONFIG with ``micro_batches``, ``epochs``, extra ``[model]`` and ``[train]`` lines and
    extra tables."""
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG.format(micro=micro, train=train, extra=extra, model=model, epochs=epochs))
    return cfg


def train(tmp: Path, name: str, nproc: int, micro: int = 1, epochs: int = 2, **lines: str) -> Path:
    """Runs to the end (asserting success) -> the run's folder."""
    cfg = write_config(tmp, name, micro, epochs=epochs, **lines)
    # a rank that dies on a signal while Python still runs prints every thread's stack
    # (faulthandler): CI's abort of this job (retrieval/training/distributed.py) showed none
    env = os.environ | {"PYTHONFAULTHANDLER": "1"}
    out = subprocess.run(
        train_cmd(cfg, tmp / name, nproc), capture_output=True, text=True, timeout=240, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp / name


def weights(run: Path) -> dict[str, torch.Tensor]:
    """The trained weights of a run's model folder, the index left out."""
    state = torch.load(run / "model" / "model.pt", weights_only=True)
    return {
        k: t for k, t in state.items() if isinstance(t, torch.Tensor) and not k.startswith("index.")
    }


def metrics(run: Path) -> dict[str, Any]:
    return json.loads((run / "metrics.json").read_text())
