"""Comparing two top-K answers (imported by tests; ``tests/`` is on the path via its conftest)."""

from __future__ import annotations

import numpy as np
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


def assert_best_eligible(
    ids: torch.Tensor, ok: np.ndarray, q: torch.Tensor, x: torch.Tensor, k: int, text: str
) -> None:
    """``ids [B, k]`` (``-1`` pads) hold each row's best ``k`` items of those ``ok [N]`` admits by
    inner product of ``q [B, D]`` with ``x [N, D]``, and only them (``text``: the filter, for the
    message)."""
    want = (q @ x.T).masked_fill(~torch.from_numpy(ok), -torch.inf).topk(k, dim=1)
    n_ok = min(k, int(ok.sum()))
    for row in range(ids.shape[0]):
        got = ids[row]
        assert (got[:n_ok] >= 0).all() and (got[n_ok:] == -1).all(), text
        assert ok[got[:n_ok]].all(), text  # never an ineligible item
        assert set(got[:n_ok].tolist()) == set(want.indices[row, :n_ok].tolist()), text
