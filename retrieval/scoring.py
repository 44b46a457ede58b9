"""Scoring of re-ranked candidates: the dot product, plus an optional learned multi-task head.

The head reads the elementwise product of query and item vectors (a learned generalization of the
dot product), predicts one logit per task and combines them with fixed task weights into one
value that is added to the dot product.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class PairHead(nn.Module):
    """``q [..., D]``, ``v [..., D]`` -> ``[...]`` combined score; ``task_logits`` gives ``[..., T]``."""

    task_weights: torch.Tensor

    def __init__(self, dim: int, hidden: int, task_weights: Sequence[float]):
        super().__init__()
        out = nn.Linear(hidden, len(task_weights))
        nn.init.zeros_(out.weight)  # starts as a no-op on top of the dot product
        nn.init.zeros_(out.bias)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), out)
        self.register_buffer("task_weights", torch.tensor(list(task_weights), dtype=torch.float32))

    def task_logits(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.mlp(q * v)

    def forward(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.task_logits(q, v) @ self.task_weights


def score_candidates(
    q: torch.Tensor,
    cand_vectors: torch.Tensor,
    dot: torch.Tensor,
    head: PairHead | None,
    temperature: float,
) -> torch.Tensor:
    """Final scores of candidates: ``q [B, D]``, ``cand_vectors [B, R, D]``, ``dot [B, R]`` -> ``[B, R]``.

    Without a head the dot product is the score. With one, ``dot / temperature + head(q, v)``:
    the same logit the head was trained on.
    """
    if head is None:
        return dot
    return dot / temperature + head(q.unsqueeze(1), cand_vectors)
