"""Sampled softmax over in-batch negatives with log-Q correction.

Every other positive item in the batch is a negative for a row. Popular items appear as negatives
more often than under uniform sampling, so each column's logit is lowered by ``log Q(item)``, its
sampling probability (Yi et al., "Sampling-bias-corrected neural modeling", RecSys 2019).
Columns holding the row's own item elsewhere in the batch are masked (not false negatives).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrieval.scoring import PairHead


def in_batch_logits(
    q: torch.Tensor, v: torch.Tensor, temperature: float, head: PairHead | None = None
) -> torch.Tensor:
    """``q [B, D]``, ``v [B, D]`` -> ``[B, B]`` logits (row: user, column: item)."""
    logits = q @ v.T / temperature
    if head is not None:
        logits = logits + head(q.unsqueeze(1), v.unsqueeze(0))  # [B, B]
    return logits


def sampled_softmax_loss(
    logits: torch.Tensor, item_ids: torch.Tensor, log_q: torch.Tensor
) -> torch.Tensor:
    """``logits [B, B]``, the batch's positive ``item_ids [B]``, their ``log_q [B]`` -> scalar loss."""
    corrected = logits - log_q.unsqueeze(0)
    same = item_ids.unsqueeze(0) == item_ids.unsqueeze(1)
    eye = torch.eye(len(item_ids), dtype=torch.bool, device=logits.device)
    corrected = corrected.masked_fill(same & ~eye, float("-inf"))
    return F.cross_entropy(corrected, torch.arange(len(item_ids), device=logits.device))
