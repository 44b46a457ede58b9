"""Exact (brute-force) top-K, optionally restricted to eligible items: the reference every
approximate result is measured against, and the plan the index takes at low selectivity."""

from __future__ import annotations

import torch

from retrieval.index.scan import topk_rows

NEG_INF = float("-inf")


def exact_search(
    vectors: torch.Tensor,
    q: torch.Tensor,
    k: int,
    eligible: torch.Tensor | None = None,
    chunk: int = 1 << 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` inner products of ``q [B, D]`` against ``vectors [N, D]``.

    ``eligible`` is ``[N]`` or ``[B, N]`` bool. Returns ``positions [B, k] int64`` into
    ``vectors`` (``-1`` where fewer than ``k`` items are eligible) and ``scores [B, k] float32``
    (``-inf`` there). Items are scanned in chunks of ``chunk`` rows, keeping a running top-k, so
    memory stays ``O(B * (chunk + k))``.
    """
    assert q.dim() == 2 and vectors.dim() == 2 and q.shape[1] == vectors.shape[1], "shape mismatch"
    b, n = q.shape[0], vectors.shape[0]
    best_s = torch.full((b, k), NEG_INF, device=q.device)
    best_p = torch.full((b, k), -1, dtype=torch.int64, device=q.device)
    qf = q.float()
    for s in range(0, n, chunk):
        block = vectors[s : s + chunk].float()
        scores = qf @ block.T  # [B, c]
        if eligible is not None:
            e = eligible[..., s : s + chunk]
            scores = scores.masked_fill(~(e if e.dim() == 2 else e.unsqueeze(0)), NEG_INF)
        pos = torch.arange(s, s + block.shape[0], device=q.device).expand(b, -1)
        all_s = torch.cat([best_s, scores], dim=1)
        all_p = torch.cat([best_p, pos], dim=1)
        best_s, idx = all_s.topk(min(k, all_s.shape[1]), dim=1)
        best_p = all_p.gather(1, idx)
    best_p = torch.where(best_s > NEG_INF, best_p, torch.full_like(best_p, -1))
    return best_p, best_s


def exact_search_subset(
    vectors: torch.Tensor, q: torch.Tensor, k: int, subset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` of ``q [B, D]`` over the rows ``subset [M] int64`` of ``vectors``, for a
    batch sharing one filter: gather the eligible rows once, one matmul, one topk. Returns
    positions into ``vectors`` (``-1`` pads) and scores, like :func:`exact_search`."""
    b = q.shape[0]
    kk = min(k, subset.numel())
    pos = torch.full((b, k), -1, dtype=torch.int64, device=q.device)
    sc = torch.full((b, k), NEG_INF, device=q.device)
    if kk == 0:
        return pos, sc
    scores = q.float() @ vectors[subset].float().T  # [B, M]
    # the bounded heap wins when k is a small part of the row; a sort when it is not
    top, idx = topk_rows(scores, kk) if 8 * kk < scores.shape[1] else scores.topk(kk, dim=1)
    pos[:, :kk] = subset[idx]
    sc[:, :kk] = top
    return pos, sc


def recall_at_k(found: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean over rows of |found ∩ truth| / |truth| (``-1`` entries ignored); ``[B, K]`` each."""
    hits, total = 0, 0
    for f, t in zip(found.tolist(), truth.tolist(), strict=True):
        ts = {x for x in t if x >= 0}
        hits += len(ts.intersection(x for x in f if x >= 0))
        total += len(ts)
    return hits / total if total else 1.0
