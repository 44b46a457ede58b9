"""Exact (brute-force) top-K, optionally restricted to eligible items: the reference every
approximate result is measured against, and the plan the index takes at low selectivity."""

from __future__ import annotations

from collections.abc import Callable

import torch

from retrieval.index.exclude import is_excluded
from retrieval.index.scan import topk_rows

NEG_INF = float("-inf")


def exact_topk(
    q: torch.Tensor,
    k: int,
    positions: torch.Tensor,
    scores_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    chunk: int = 1 << 16,
    excl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` inner products of ``q [B, D]`` over the items ``positions [M] int64``, less
    the rows each query excludes (``excl [B, S]``, ``retrieval/index/exclude.py``).

    ``scores_at(q, pos)`` returns ``q``'s scores of those items ``[B, m]`` (a gather and a
    matmul, or scores read off codes), called once per chunk of ``chunk`` items, so memory
    stays ``O(B * (chunk + k))`` whatever M.
    Returns ``positions [B, k] int64`` (``-1`` where M < k) and ``scores [B, k] float32``
    (``-inf`` there), best first.
    """
    b = q.shape[0]
    best_s = torch.full((b, k), NEG_INF, device=q.device)
    best_p = torch.full((b, k), -1, dtype=torch.int64, device=q.device)
    qf = q.float()
    for s in range(0, positions.numel(), chunk):
        part = positions[s : s + chunk]
        scores = scores_at(qf, part)  # [B, m]
        if excl is not None and excl.shape[1]:
            scores = scores.masked_fill(is_excluded(part.expand(b, -1), excl), NEG_INF)
        if s == 0:  # the first chunk needs no merge with the empty best
            all_s, all_p = scores, part.expand(b, -1)
        else:
            all_s = torch.cat([best_s, scores], dim=1)
            all_p = torch.cat([best_p, part.expand(b, -1)], dim=1)
        if all_s.shape[1] < k:  # fewer items than k so far: pad
            all_s = torch.cat([all_s, best_s[:, : k - all_s.shape[1]]], dim=1)
            all_p = torch.cat([all_p, best_p[:, : k - all_p.shape[1]]], dim=1)
        best_s, idx = topk_rows(all_s, k)  # -1 where a row has fewer than k finite scores
        best_p = all_p.gather(1, idx.clamp(min=0))
    return torch.where(best_s > NEG_INF, best_p, torch.full_like(best_p, -1)), best_s


def exact_search(
    vectors: torch.Tensor, q: torch.Tensor, k: int, eligible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of ``q [B, D]`` against ``vectors [N, D]``, restricted to ``eligible [N] bool``
    when given; positions index ``vectors``. The reference approximate results are measured by."""
    assert q.dim() == 2 and vectors.dim() == 2 and q.shape[1] == vectors.shape[1], "shape mismatch"
    n = vectors.shape[0]
    pos = eligible.nonzero().flatten() if eligible is not None else torch.arange(n, device=q.device)
    return exact_topk(q, k, pos, lambda qf, p: qf @ vectors.index_select(0, p).float().T)


def recall_at_k(found: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean over rows of |found ∩ truth| / |truth| (``-1`` entries ignored); ``[B, K]`` each."""
    hits, total = 0, 0
    for f, t in zip(found.tolist(), truth.tolist(), strict=True):
        ts = {x for x in t if x >= 0}
        hits += len(ts.intersection(x for x in f if x >= 0))
        total += len(ts)
    return hits / total if total else 1.0
