"""Sampled softmax over in-batch (and optionally random) negatives with log-Q correction.

Every other positive item in the batch is a negative for a row; ``R`` items drawn uniformly
from the catalog can join them (mixed negative sampling, Yang et al., WWW 2020). Popular items
appear as in-batch negatives more often than rare ones, so each column's logit is lowered by the
log of its expected count among the negatives, ``log(B * Q(item) + R / N)`` with ``Q`` the
item's share of the training pairs (Yi et al., "Sampling-bias-corrected neural modeling", RecSys
2019). With ``R = 0`` that is ``log Q + log B``: the constant changes nothing. Columns holding
the row's own item elsewhere (a repeat in the batch, or a random draw) are masked, so a positive
is never its own negative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrieval.scoring import PairHead


def in_batch_logits(
    q: torch.Tensor,
    v: torch.Tensor,
    temperature: float,
    head: PairHead | None = None,
    task_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [B, D]``, column vectors ``v [C, D]`` -> ``[B, C]`` logits (row: user, column: item).
    With a head, its combined value is added (from ``task_logits [B, C, T]`` when the caller
    has them, so the head runs once)."""
    logits = q @ v.T / temperature
    if head is not None:
        if task_logits is None:
            task_logits = head.task_logits(q.unsqueeze(1), v.unsqueeze(0))
        logits = logits + task_logits @ head.task_weights  # [B, C]
    return logits


def task_loss(
    task_logits: torch.Tensor,
    row_labels: torch.Tensor,
    item_ids: torch.Tensor,
    column_ids: torch.Tensor,
) -> torch.Tensor:
    """Mean binary cross-entropy of each task's logit -> scalar. ``task_logits [B, C, T]`` with
    the batch's positives ``item_ids [B]`` as the first B of ``column_ids [C]``; row i's own
    column has ``row_labels [B, T]``, every other column 0, except a column holding row i's
    item elsewhere (a repeat), which is left out, and a task without labels (NaN), which is
    left out of every column."""
    labelled = ~torch.isnan(row_labels[0]) if len(row_labels) else row_labels.new_ones(0).bool()
    task_logits, row_labels = task_logits[..., labelled], row_labels[:, labelled]
    b = item_ids.shape[0]
    labels = torch.zeros_like(task_logits)
    own = torch.arange(b, device=task_logits.device)
    labels[own, own] = row_labels
    same = item_ids.unsqueeze(1) == column_ids.unsqueeze(0)  # [B, C]
    same[own, own] = False
    keep = (~same).unsqueeze(2).expand_as(task_logits)
    return F.binary_cross_entropy_with_logits(task_logits[keep], labels[keep])


def column_log_q(log_q: torch.Tensor, batch: int, random: int, num_items: int) -> torch.Tensor:
    """``log(B * Q + R / N)`` per column from ``log_q [C]`` (each column item's log share)."""
    expected = batch * log_q.exp()
    if random:
        expected = expected + random / num_items
    return torch.log(expected)


def sampled_softmax_loss(
    logits: torch.Tensor,
    item_ids: torch.Tensor,
    column_ids: torch.Tensor,
    column_log_q: torch.Tensor,
) -> torch.Tensor:
    """Mean cross-entropy of each row's positive (column ``i`` of row ``i``) -> scalar.

    ``logits [B, C]`` with the batch's positives ``item_ids [B]`` as the first B columns and
    ``C - B`` extra negatives after them; ``column_ids [C]``, ``column_log_q [C]`` (see
    :func:`column_log_q`).
    """
    b = item_ids.shape[0]
    corrected = logits - column_log_q.unsqueeze(0)
    same = item_ids.unsqueeze(1) == column_ids.unsqueeze(0)  # [B, C]
    own = torch.zeros_like(same)
    own[:, :b] = torch.eye(b, dtype=torch.bool, device=logits.device)
    corrected = corrected.masked_fill(same & ~own, float("-inf"))
    return F.cross_entropy(corrected, torch.arange(b, device=logits.device))
