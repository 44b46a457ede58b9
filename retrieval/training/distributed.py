"""More than one training process (torchrun): tables sharded by TorchRec, dense parts
data-parallel.

    torchrun --nproc_per_node 2 -m recserve train --config train.toml

Each of the W ranks trains on its slice of every global batch (``batch_size / W`` pairs). A step:

    tables        TorchRec's DistributedModelParallel over the plan of [train.sharding]
                  (retrieval/training/sharding.py, dmp_tables.py): ids go to the ranks that
                  hold their rows, pooled rows come back; backward updates the rows on their
                  owners through fbgemm's fused optimizer
    towers, loss  per rank (its slice: in-batch negatives are the slice's own)
    dense grads   all_reduce (mean): every rank steps Adam identically (:func:`average_gradients`)

With table-wise sharding that is exactly one process training with ``micro_batches = W`` (each
slice a softmax of its own, one table update for the whole batch, mean loss), up to the order of
float sums; ``tests/retrieval/training/test_distributed.py`` checks it. Backend: gloo, tables on
the CPU. Checkpoints: ``torch.distributed.checkpoint`` (retrieval/training/dcp_checkpoint.py).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistContext:
    """This process's place in a torchrun job: ``rank`` of ``world``."""

    rank: int
    world: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_from_env() -> DistContext | None:
    """Joins the process group torchrun describes (``WORLD_SIZE`` > 1); None for one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # the tables and their exchange live on the CPU
    return DistContext(dist.get_rank(), dist.get_world_size())


def leave_job(code: int) -> NoReturn:
    """Ends this rank's process with ``code`` once its own work is done and written (rank 0's:
    the model saved and published): the process group is destroyed, logs and streams are
    flushed, and the process exits without the interpreter's teardown.

    Why not a plain return: a rank aborted now and then in CI after its last collective
    (SIGABRT, "terminate called without an active exception"), so torchrun failed a job whose
    files were all written. ``destroy_process_group`` leaves gloo's threads running
    (``pt_gloo_runloop``, ``gloo_tcp_loop``: nothing in Python holds the group any more, the C++
    side still does) until the process exits, where they are torn down among the interpreter's
    and the libraries' own destructors: where such an abort fits. ``os._exit`` runs no static
    destructors, so there is no such teardown to race."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def average_gradients(params: list[nn.Parameter], world: int) -> None:
    """Dense gradients: the mean over ranks (one flat all_reduce)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    start = 0
    for g in grads:
        g.copy_(flat[start : start + g.numel()].view_as(g))
        start += g.numel()
