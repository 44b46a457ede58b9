"""The planned rounds alone, as the reference every executor backend is held to in tests: a
fresh plan (no kept one), then ``search.run_search`` over step-by-step candidates (no one-call
backend), positions mapped to ids where asked."""

from __future__ import annotations

import torch

from retrieval.filters import FilterBatch
from retrieval.index import IVFIndex
from retrieval.index.plan import SearchParams, SearchPlan
from retrieval.index.planner import make_plan


def planned(
    index: IVFIndex,
    q: torch.Tensor,
    k: int,
    fb: FilterBatch | None,
    nprobe: int,
    rerank: int = 0,
    exact: bool = False,
    target: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [B, k], scores [B, k])`` of the planned rounds."""
    t = index.tensors()
    plan = make_plan(t, fb, SearchParams(k, nprobe, rerank, exact, target), q)
    top = index.executor.rounds(t, q, fb, plan)
    return top.keys, top.scores


def planned_ids(
    index: IVFIndex, q: torch.Tensor, k: int, fb: FilterBatch | None, nprobe: int, rerank: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(item ids [B, k], scores [B, k])`` of the planned rounds."""
    pos, scores = planned(index, q, k, fb, nprobe, rerank)
    return index.ids_at(pos), scores


def kept_plan(
    index: IVFIndex, q: torch.Tensor, k: int, fb: FilterBatch | None, nprobe: int
) -> SearchPlan:
    """The plan the executor runs for this search (from its kept plans where it holds one)."""
    return index.executor.plans.plan(index.tensors(), fb, index.params(k, nprobe, 0), q)
