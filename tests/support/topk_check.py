"""Comparing two top-K answers (imported by tests; ``tests/`` is on the path via its conftest)."""

from __future__ import annotations

import torch


def assert_same_topk(
    ids_a: torch.Tensor,
    scores_a: torch.Tensor,
    ids_b: torch.Tensor,
    scores_b: torch.Tensor,
    atol: float = 1e-4,
) -> None:
    """Two top-K answers ``[B, K]`` are the same: equal scores, and equal ids except where two
    neighbouring scores tie within ``atol`` (their order is then arbitrary). ``atol`` covers
    float32 sums taken in another order (a matmul over a shard's items blocks differently)."""
    assert ids_a.shape == ids_b.shape
    assert torch.equal(scores_a.isinf(), scores_b.isinf())
    fin = scores_a.isfinite()
    torch.testing.assert_close(scores_a[fin], scores_b[fin], atol=atol, rtol=0)
    differ = ids_a != ids_b
    if bool(differ.any()):
        s = scores_a.double()
        gap_prev = torch.cat([torch.full_like(s[:, :1], float("inf")), s[:, :-1] - s[:, 1:]], 1)
        gap_next = torch.cat([s[:, :-1] - s[:, 1:], torch.full_like(s[:, :1], float("inf"))], 1)
        tie = (gap_prev <= atol) | (gap_next <= atol)
        assert bool(tie[differ].all()), f"ids differ where scores do not tie: {differ.sum()} slots"
