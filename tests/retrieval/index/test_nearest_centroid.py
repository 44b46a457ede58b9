"""The int8 nearest-centroid kernel (k-means' assignment and the build's) against exact argmax in
double, and the k-means loop on it against faiss's, on each SIMD path this CPU runs (VNNI, AVX2;
the portable path's builds take faiss's float search instead: the last test)."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.index.kmeans import (
    _assign_and_sum,
    _split_empty,
    assign,
    int8_assigns,
    nearest,
    quantize_rows,
    train_centroids,
)
from retrieval.index.scan import ISA_ENV
from support.isa import SIMD, force, forced

each_path = pytest.mark.parametrize("isa", SIMD)


def exact_labels(x: torch.Tensor, c: torch.Tensor, by: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, scores [N, K]) of x·c (- |c|^2 / 2 for l2) in double."""
    xd, cd = x.double(), c.double()
    scores = xd @ cd.T - (0.5 * (cd * cd).sum(1) if by == "l2" else 0.0)
    return scores.argmax(1), scores


def assert_best(labels: torch.Tensor, x: torch.Tensor, c: torch.Tensor, by: str) -> None:
    """Every label is an exact best: its double score equals the row's maximum up to rounding."""
    truth, scores = exact_labels(x, c, by)
    got = scores.gather(1, labels[:, None])[:, 0]
    top = scores.gather(1, truth[:, None])[:, 0]
    tol = 1e-9 * (scores.abs().amax(1) + 1)
    assert bool(((top - got) <= tol).all()), (labels != truth).nonzero()[:5]


@each_path
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    d=st.integers(1, 140),
    k=st.integers(1, 70),
    by=st.sampled_from(["l2", "ip"]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_labels_are_the_exact_best(isa, n, d, k, by, scale, seed):
    """Any shape (D and K off the tile's multiples) and magnitude: the exact argmax, not the int8
    one; rows quantized once (k-means' sample) give the same labels and exact scores."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * scale
    c = torch.randn(k, d, generator=g) * scale * 0.5
    with forced(isa):
        labels, scored = nearest(x, c, by)
        again, scored_again = nearest(x, c, by, quantize_rows(x))
    assert labels.dtype == torch.int64 and labels.shape == (n,)
    assert n <= scored <= n * k
    assert_best(labels, x, c, by)
    assert torch.equal(again, labels) and scored_again == scored


@each_path
@pytest.mark.parametrize("by", ["l2", "ip"])
def test_near_ties_go_to_the_exact_winner(isa, by, monkeypatch):
    """Rows a hair's breadth nearer one of two centroids (far below int8's resolution), and rows
    on clustered data with 4096 lists: the exact winner every time."""
    force(monkeypatch, isa)
    g = torch.Generator().manual_seed(3)
    c = torch.randn(64, 48, generator=g)
    a, b = c[:32], c[32:]
    t = torch.rand(32, 1, generator=g)
    mid = (a + b) / 2 if by == "l2" else torch.randn(32, 48, generator=g)
    nudge = 1e-5 * (a - b) if by == "l2" else 0.0
    x = torch.cat([mid + nudge, mid - nudge, t * a + (1 - t) * b])
    assert_best(nearest(x, c, by)[0], x, c, by)

    centres = torch.randn(300, 64, generator=g) * 3
    x = centres[torch.randint(300, (20_000,), generator=g)] + torch.randn(20_000, 64, generator=g)
    c = x[torch.randperm(20_000, generator=g)[:4096]]
    labels, scored = nearest(x, c, by)
    assert_best(labels, x, c, by)
    assert scored < 20 * len(x)  # the bound sends a few centroids, not all, to exact scores


@each_path
def test_a_non_finite_row_is_refused_and_rows_of_another_x_or_path_too(isa, monkeypatch):
    force(monkeypatch, isa)
    x = torch.randn(10, 8)
    x[7, 3] = float("nan")
    with pytest.raises(RuntimeError, match="row 7 of x has a non-finite value"):
        nearest(x, torch.randn(4, 8), "l2")
    with pytest.raises(RuntimeError, match=r"rows: not quantize_rows\(x\) of this x"):
        nearest(torch.randn(10, 8), torch.randn(4, 8), "l2", quantize_rows(torch.randn(9, 8)))
    x = torch.randn(10, 8)
    rows = quantize_rows(x)
    force(monkeypatch, "avx2" if isa == "vnni" else "vnni")  # the other path's bytes would saturate
    with pytest.raises(RuntimeError, match=r"rows: not quantize_rows\(x\) of this x on this path"):
        nearest(x, torch.randn(4, 8), "l2", rows)


@each_path
@pytest.mark.parametrize("n", [5, 1000, 20_003])
def test_kmeans_sums_match_index_add_and_no_thread_count_changes_a_bit(isa, n, monkeypatch):
    """The sums taken inside the assignment (k-means' update) are the rows' sums by label, and
    the same bits on 1 thread and on 3 (fixed parts, added in order)."""
    force(monkeypatch, isa)
    g = torch.Generator().manual_seed(n)
    x, c = torch.randn(n, 37, generator=g), torch.randn(50, 37, generator=g)
    rows = quantize_rows(x)
    before = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            got.append(_assign_and_sum(x, c, "l2", rows))
    finally:
        torch.set_num_threads(before)
    (labels, sums), (labels3, sums3) = got
    assert torch.equal(labels, nearest(x, c, "l2")[0]) and torch.equal(labels3, labels)
    assert torch.equal(sums3, sums)
    truth = torch.zeros_like(c, dtype=torch.float64).index_add_(0, labels, x.double())
    torch.testing.assert_close(sums.double(), truth, rtol=1e-4, atol=1e-3)  # float sums of rows


def inertia(x: torch.Tensor, c: torch.Tensor) -> float:
    """Sum of squared distances of x to their nearest centroid."""
    return float(torch.cdist(x.double(), c.double()).amin(1).pow(2).sum())


@each_path
def test_kmeans_is_as_tight_as_faiss(isa, monkeypatch):
    """Our k-means loop and faiss's, same sample and iterations: inertia within 3 %."""
    force(monkeypatch, isa)
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(200, 32, generator=g) * 2
    x = centres[torch.randint(200, (20_000,), generator=g)] + torch.randn(20_000, 32, generator=g)
    ours = train_centroids(x, 256, iters=10)
    cp = faiss.ClusteringParameters()
    cp.niter, cp.seed, cp.verbose, cp.min_points_per_centroid = 10, 0, False, 1
    clustering = faiss.Clustering(32, 256, cp)
    clustering.train(x.numpy(), faiss.IndexFlatL2(32))
    theirs = torch.from_numpy(faiss.vector_to_array(clustering.centroids).reshape(256, 32))
    assert ours.shape == (256, 32) and bool(torch.isfinite(ours).all())
    assert inertia(x, ours) <= 1.03 * inertia(x, theirs)


@each_path
def test_duplicate_points_leave_no_list_without_a_centroid_of_its_own(isa, monkeypatch):
    """Eight distinct points, each repeated: k-means into 8 lists starts with duplicated centroids
    (empty lists), which take halves of large lists until every point has its own list."""
    force(monkeypatch, isa)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).repeat(50, 1)
    c = train_centroids(x, 8, iters=10)
    labels = assign(x, c)
    assert len(set(labels.tolist())) == 8


def test_split_gives_every_empty_list_half_of_a_large_one():
    c = torch.ones(4, 6)
    counts = np.array([0, 10, 0, 1])
    _split_empty(c, counts.copy(), np.random.default_rng(0))
    assert not torch.equal(c[0], c[2])  # each empty list moved off its lender
    assert torch.allclose(c, torch.ones(4, 6), rtol=2e-3)  # by SPLIT_EPS, not more
    assert torch.equal(c[3], torch.ones(6))  # a one-point list lends nothing


def test_the_portable_path_assigns_by_faiss(monkeypatch):
    """The portable path (a CPU without AVX2, or forced) builds with faiss's float search: the
    same exact labels."""
    monkeypatch.setenv(ISA_ENV, "portable")
    assert not int8_assigns()
    g = torch.Generator().manual_seed(2)
    x, c = torch.randn(500, 24, generator=g), torch.randn(40, 24, generator=g)
    assert_best(assign(x, c, "l2"), x, c, "l2")
