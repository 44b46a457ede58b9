"""More than one training process (torchrun): tables sharded table-wise, dense parts data-parallel.

    torchrun --nproc_per_node 2 -m recserve train --config train.toml

Each of the W ranks owns whole tables (greedy by bytes, :func:`assign_tables`) in its own fbgemm
training TBE and trains on its slice of every global batch (``batch_size / W`` pairs). A step:

    ids of every feature      all_gather            every rank sees all W slices' ids
    owner: pooled rows        one TBE call over the W slices of its tables
    pooled slice per rank     scatter from owner    [B/W, D] back to each rank
    towers, loss              per rank (its slice: in-batch negatives are the slice's own)
    backward: pooled grads    gather to owner       owner's fused optimizer updates its rows
    dense grads               all_reduce (mean)     every rank steps Adam identically

That is exactly one process training with ``micro_batches = W`` (each slice a softmax of its
own, one table update for the whole batch, mean loss), up to the order of float sums in the
reductions; ``tests/retrieval/training/test_distributed.py`` checks it. Backend: gloo; the
exchange and the tables live on the CPU (a GPU/nccl variant is not built). Checkpoints of a
multi-process run are not built yet (refused at start).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sharded_tables.collection import TableConfig
from sharded_tables.interface import TableHooks
from sharded_tables.trainable import TrainableTables


@dataclass(frozen=True)
class DistContext:
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
        dist.init_process_group("gloo")  # the exchange's tensors are on the CPU
    return DistContext(dist.get_rank(), dist.get_world_size())


def assign_tables(tables: list[TableConfig], world: int) -> dict[str, int]:
    """Table -> owning rank: largest first onto the least-loaded rank (bytes of float rows)."""
    load = [0] * world
    owner = {}
    for t in sorted(tables, key=lambda t: (-t.num_embeddings * t.dim, t.name)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[t.name] = r
        load[r] += t.num_embeddings * t.dim
    return owner


class _Exchange(torch.autograd.Function):
    """Owner's pooled rows of all W slices -> every rank's own slice (forward: scatter);
    slices' gradients -> owner (backward: gather), scaled by 1/W (the loss is the mean of the
    W ranks' losses)."""

    @staticmethod
    def forward(
        ctx: Any, owned: torch.Tensor, plan: list[tuple[int, int, int]], b: int, world: int
    ) -> torch.Tensor:
        """``owned [W*b, sum of owned dims]``; ``plan``: per feature (owner, width, column in
        ``owned`` when this rank owns it else -1) -> ``[b, sum of all dims]``."""
        ctx.plan, ctx.b, ctx.world = plan, b, world
        ctx.owned_shape = owned.shape
        outs = []
        for owner, width, col in plan:
            out = torch.empty(b, width)
            chunks = list(owned[:, col : col + width].split(b)) if col >= 0 else None
            dist.scatter(out, [c.contiguous() for c in chunks] if chunks else None, src=owner)
            outs.append(out)
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        grad_owned = torch.zeros(ctx.owned_shape)
        start = 0
        for owner, width, col in ctx.plan:
            g = grad[:, start : start + width].contiguous() / ctx.world
            start += width
            parts = [torch.empty_like(g) for _ in range(ctx.world)] if col >= 0 else None
            dist.gather(g, parts, dst=owner)
            if parts is not None:
                grad_owned[:, col : col + width] = torch.cat(parts)
        return grad_owned, None, None, None


class ShardedTrainableTables(TableHooks, nn.Module):
    """The call shape of :class:`TrainableTables` over tables owned by different ranks (a
    :class:`~sharded_tables.interface.TableCollection`; rows are not written in place)."""

    def __init__(
        self,
        tables: list[TableConfig],
        ctx: DistContext,
        optimizer: str,
        learning_rate: float,
        weights: Mapping[str, torch.Tensor],
    ):
        super().__init__()
        self.ctx = ctx
        self.configs = {t.name: t for t in tables}
        self.owner = assign_tables(tables, ctx.world)
        self.table_of = {f: t.name for t in tables for f in t.feature_names()}
        mine = [t for t in tables if self.owner[t.name] == ctx.rank]
        self.local = (
            TrainableTables(mine, optimizer=optimizer, learning_rate=learning_rate)
            if mine
            else None
        )
        if self.local is not None:
            self.local.load_weights({t.name: weights[t.name] for t in mine})

    def table_rows(self) -> dict[str, int | None]:
        return {name: cfg.num_embeddings for name, cfg in self.configs.items()}

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        return {name: (cfg.num_embeddings, cfg.dim) for name, cfg in self.configs.items()}

    def float_weights(self) -> dict[str, torch.Tensor]:
        """:meth:`all_weights`: a collective, every rank must call it."""
        return self.all_weights()

    def load_float(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies the rows of this rank's tables from ``weights`` (others are ignored); -> ``{}``."""
        if self.local is not None:
            self.local.load_weights({n: w for n, w in weights.items() if n in self.local.configs})
        return {}

    def validate(self, features: Mapping[str, torch.Tensor]) -> None:
        for f in features:
            if f not in self.table_of:
                raise ValueError(f"unknown feature {f!r}")

    def forward(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{feature: ids [b, L]}`` (same shapes on every rank) -> ``{feature: [b, D]}``."""
        world, rank = self.ctx.world, self.ctx.rank
        names = sorted(features)  # one order on every rank
        gathered = {}
        for f in names:
            parts = [torch.empty_like(features[f]) for _ in range(world)]
            dist.all_gather(parts, features[f].contiguous())
            gathered[f] = torch.cat(parts)  # [W*b, L]
        b = features[names[0]].shape[0]
        mine = [f for f in names if self.owner[self.table_of[f]] == rank]
        pooled = self.local({f: gathered[f] for f in mine}) if self.local and mine else {}
        # a rank that owns none of these features still joins backward's gathers: its input
        # must require grad, or autograd would skip the exchange's backward there
        owned = (
            torch.cat([pooled[f] for f in mine], dim=1)
            if mine
            else torch.zeros(world * b, 0, requires_grad=True)
        )
        plan, col = [], 0
        for f in names:
            width = self.configs[self.table_of[f]].dim
            if f in pooled:
                plan.append((self.owner[self.table_of[f]], width, col))
                col += width
            else:
                plan.append((self.owner[self.table_of[f]], width, -1))
        out = _Exchange.apply(owned, plan, b, world)
        result, start = {}, 0
        for f, (_, width, _) in zip(names, plan, strict=True):
            result[f] = out[:, start : start + width]
            start += width
        return result

    def all_weights(self) -> dict[str, torch.Tensor]:
        """Every table's float rows on every rank (broadcast from its owner)."""
        live = self.local.weights() if self.local is not None else {}
        out = {}
        for name in sorted(self.configs):
            cfg = self.configs[name]
            rows = live[name].clone() if name in live else torch.empty(cfg.num_embeddings, cfg.dim)
            dist.broadcast(rows, src=self.owner[name])
            out[name] = rows
        return out


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
