"""Checkpoints of a torchrun job: the sharded tables through ``torch.distributed.checkpoint``.

A checkpoint is a folder ``checkpoint_dir/step-<global step>-<nonce>/`` holding

* DCP's files: every rank's shards of the table rows and of the fused optimizer's state
  (``DMPTables.sharded_state``: ShardedTensors, each rank writes its own);
* ``trainer.pt``: what every rank holds alike (dense weights, Adam's state, the counters,
  validation results, the stopper and the best epoch's weights), written by rank 0, loadable
  with ``weights_only``.

``checkpoint_dir/LATEST`` names the newest complete one. It is written (atomically, by rank 0)
only after every rank has finished its part, and older folders are removed only after that:
a job killed while saving leaves ``LATEST`` on the previous checkpoint, whole. Resuming needs
the same number of ranks (the batch slices of a step follow the rank).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.atomic import atomic_writer

LATEST = "LATEST"
TRAINER_FILE = "trainer.pt"
PREFIX = "step-"


def latest(checkpoint_dir: Path) -> Path | None:
    """The folder ``LATEST`` names, or None when there is no complete checkpoint."""
    pointer = checkpoint_dir / LATEST
    if not pointer.is_file():
        return None
    folder = checkpoint_dir / pointer.read_text().strip()
    if not (folder / TRAINER_FILE).is_file():
        raise ValueError(f"{pointer}: names {folder.name}, which holds no {TRAINER_FILE}")
    return folder


def save(checkpoint_dir: Path, trainer_state: dict[str, Any], sharded: dict[str, Any]) -> Path:
    """Writes one checkpoint (a collective: every rank calls it) and points ``LATEST`` at it.
    ``trainer_state``: rank 0's is written; ``sharded``: each rank's shards."""
    rank = dist.get_rank()
    name = [f"{PREFIX}{trainer_state['global_step']:08d}-{time.time_ns()}" if rank == 0 else ""]
    dist.broadcast_object_list(name, src=0)  # one folder name on every rank
    folder = checkpoint_dir / name[0]
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    import torch.distributed.checkpoint as dcp  # 1 s of imports (DTensor, sympy): only to save

    dcp.save(sharded, checkpoint_id=folder)
    if rank == 0:
        with atomic_writer(folder / TRAINER_FILE) as fh:
            torch.save({**trainer_state, "world": dist.get_world_size()}, fh)
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        with atomic_writer(checkpoint_dir / LATEST) as fh:
            fh.write(name[0].encode())
        for old in checkpoint_dir.glob(f"{PREFIX}*"):
            if old.name != name[0] and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return folder


def load(folder: Path, sharded: dict[str, Any]) -> dict[str, Any]:
    """Fills ``sharded`` (this rank's live shards, in place) from ``folder``; -> the trainer
    state. ``ValueError`` when the checkpoint was written by another number of ranks."""
    state = torch.load(folder / TRAINER_FILE, weights_only=True)
    world = dist.get_world_size()
    if state["world"] != world:
        raise ValueError(
            f"--resume: {folder} was written by {state['world']} ranks, this job has {world} "
            "(resume with the same --nproc_per_node)"
        )
    import torch.distributed.checkpoint as dcp  # (as in save)

    dcp.load(sharded, checkpoint_id=folder)
    return state
