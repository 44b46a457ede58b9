"""bench/ann_data.py: the data built in place and the exact truth searched in chunks are what
the whole-array versions give (the 10M benches depend on both to fit in memory)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from ann_data import _around, exact_topk, make_data


def test_around_is_centres_plus_noise() -> None:
    centres = np.random.default_rng(3).standard_normal((50, 8), dtype=np.float32)
    n = (1 << 20) + 5  # past one chunk of the in-place sum
    got = _around(centres, n, np.random.default_rng(4))
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 50, size=n)
    noise = rng.standard_normal((n, 8), dtype=np.float32)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    assert np.array_equal(got, centres[labels] + noise)


def test_exact_topk_in_chunks_is_the_exact_top() -> None:
    data = make_data(3000, 16, 20)
    scores = data.q @ data.x.T  # [B, N]
    eligible = np.flatnonzero(np.random.default_rng(5).random(3000) < 0.3)
    for ids_in in (None, eligible, eligible[:7]):
        got = exact_topk(data.x, data.q, 10, ids_in, chunk=256)  # [B, 10]
        rows = np.arange(3000) if ids_in is None else ids_in
        want = rows[np.argsort(-scores[:, rows], axis=1, kind="stable")[:, :10]]
        if len(rows) < 10:
            want = np.hstack([want, np.full((20, 10 - len(rows)), -1)])
        # the same scores in the same order (faiss's BLAS and NumPy's may round a near tie apart)
        assert ((got >= 0) == (want >= 0)).all()
        top = np.take_along_axis(scores, np.maximum(got, 0), axis=1)
        ref = np.take_along_axis(scores, np.maximum(want, 0), axis=1)
        assert np.allclose(np.where(got >= 0, top, 0), np.where(want >= 0, ref, 0), atol=1e-4)
        assert np.array_equal(got, exact_topk(data.x, data.q, 10, ids_in))  # one chunk
    assert (exact_topk(data.x, data.q, 5, eligible[:0]) == -1).all()
