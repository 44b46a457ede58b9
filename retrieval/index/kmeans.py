"""Coarse quantizer training and assignment: k-means and the nearest centroid of every item.

On a CPU with AVX-512 VNNI or AVX2 both run on our kernel (``csrc/nearest_centroid.cpp``): int8
scores of every centroid, the few within their error bound of the best scored exactly, so each row
gets its exact nearest centroid at several times (VNNI) or twice (AVX2) the multiply-adds per
instruction of a float search at the same vector width (the build's time: ``bench/RESULTS.md``). Elsewhere (or
with ``$RECSERVE_SCAN_ISA=portable``) faiss's ``Clustering`` and ``IndexFlat`` do it. The k-means
loop is faiss's: points sampled up to ``max_points_per_centroid`` per list, centroids started at
random points, each iteration assigns and takes means, and an empty list takes half of a large
one.

faiss asks for at least ``MIN_POINTS_PER_CENTROID`` (39) points per centroid and prints a
"please provide at least N training points" line on stderr for every smaller training set.
:func:`default_nlist` keeps catalog-sized defaults above that bound; a larger ``nlist`` asked for
explicitly still trains (its centroids are noisier) and is explained once per process in our
log instead of once per build on stderr.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import faiss
import numpy as np
import torch

from common.cpp_extension import load_extension
from retrieval.index.config import MIN_POINTS_PER_CENTROID, default_nlist
from retrieval.index.scan import int8_isa

log = logging.getLogger(__name__)

_explained: set[tuple[int, int]] = set()
_SRC = Path(__file__).parent / "csrc" / "nearest_centroid.cpp"
SPLIT_EPS = 1.0 / 1024
"""An empty list takes a copy of a large list's centroid; the two move apart by this share per
dimension (faiss's ``EPS`` in its ``split_clusters``)."""


def train_centroids(
    x: torch.Tensor,
    nlist: int,
    *,
    iters: int = 20,
    seed: int = 0,
    max_points_per_centroid: int = 256,
    by: str = "l2",
) -> torch.Tensor:
    """k-means centroids of ``x [N, D]`` -> ``[nlist, D] float32`` (``nlist <= N``); each
    iteration assigns points by ``by``: "l2" (nearest), "ip" (largest x·c, as faiss trains an
    inner-product IVF)."""
    assert x.dim() == 2, f"x must be [N, D], got {tuple(x.shape)}"
    _explain_small(len(x), nlist)
    if int8_assigns():
        return _lloyd(_as_rows(x), nlist, iters, seed, max_points_per_centroid, by)
    xn = _as_rows(x).numpy()
    cp = faiss.ClusteringParameters()
    cp.niter, cp.seed, cp.verbose = iters, seed, False
    cp.max_points_per_centroid = max_points_per_centroid
    cp.min_points_per_centroid = 1  # faiss's own warning, said once by _explain_small instead
    clustering = faiss.Clustering(xn.shape[1], nlist, cp)
    clustering.train(xn, _flat(xn.shape[1], by))
    centroids = faiss.vector_to_array(clustering.centroids).reshape(nlist, xn.shape[1])
    return torch.from_numpy(np.ascontiguousarray(centroids)).float()


def int8_assigns() -> bool:
    """Whether k-means and assignment run on the int8 kernel: the int8 scan's path is VNNI or
    AVX2 (the best this CPU has, unless ``$RECSERVE_SCAN_ISA`` forces another); a portable
    path takes faiss's float search."""
    return int8_isa() in ("vnni", "avx2")


def _avx2() -> bool:
    """The int8 kernel's AVX2 path (no VNNI): its rows are quantized to 31 levels, not 127."""
    return int8_isa() == "avx2"


def build_kernel() -> None:
    """Compiles the nearest-centroid kernel now, if not cached (``recserve kernels``)."""
    _extension()


def _extension() -> ModuleType:
    return load_extension(
        "recserve_nearest_centroid", _SRC, ("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)
    )


SUM_PARTS = 16
"""Fixed parts k-means' sums are taken in (each summed in row order, then the parts in order):
fixed, so no thread count changes the centroids."""
SUM_PARTS_BYTES = 256 << 20
"""The parts' buffers (``SUM_PARTS x nlist x D`` floats) at most; more lists sum by ``index_add_``."""

QuantizedRows = tuple[torch.Tensor, torch.Tensor]
"""``(q [N, ceil(D/4)*4] int8, meta [N, 5] float64)``: rows as the int8 kernel's path quantizes
them (the kernel refuses rows of the other path)."""


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """``x [N, D]`` float32 quantized once for every :func:`nearest` call against it (k-means
    assigns the same sample each iteration: re-quantizing it was a third of each call)."""
    return _extension().quantize_rows(x, _avx2())


def nearest(
    x: torch.Tensor, centroids: torch.Tensor, by: str, rows: QuantizedRows | None = None
) -> tuple[torch.Tensor, int]:
    """``(labels [N] int64, exact scores taken)`` of ``x [N, D]`` against ``centroids [K, D]``
    (float32 CPU) on the int8 kernel: the exact best by ``by`` ("l2" or "ip") of every row.
    ``rows``: :func:`quantize_rows` of ``x`` (None: quantized in the call)."""
    labels, scored, _ = _extension().nearest_centroids(x, centroids, by == "l2", rows, 0, _avx2())
    return labels, int(scored)


def _assign_and_sum(
    x: torch.Tensor, centroids: torch.Tensor, by: str, rows: QuantizedRows
) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means' step: ``(labels [N], sums [K, D] float32 of x's rows by label)``. The kernel
    sums each row while its exact check has it in cache, in :data:`SUM_PARTS` fixed parts,
    when their buffers fit :data:`SUM_PARTS_BYTES`; else ``index_add_`` (a pass of its own)."""
    k, d = centroids.shape
    if SUM_PARTS * k * d * 4 <= SUM_PARTS_BYTES:
        labels, _, sums = _extension().nearest_centroids(
            x, centroids, by == "l2", rows, SUM_PARTS, _avx2()
        )
        return labels, sums
    labels, _ = nearest(x, centroids, by, rows)
    return labels, torch.zeros_like(centroids).index_add_(0, labels, x)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().float().contiguous()


def _lloyd(
    x: torch.Tensor, nlist: int, iters: int, seed: int, max_points_per_centroid: int, by: str
) -> torch.Tensor:
    """faiss's k-means loop on the int8 kernel: ``x [N, D]`` -> ``[nlist, D]`` float32."""
    gen = torch.Generator().manual_seed(seed)
    if len(x) > nlist * max_points_per_centroid:
        x = x[torch.randperm(len(x), generator=gen)[: nlist * max_points_per_centroid]]
    centroids = x[torch.randperm(len(x), generator=gen)[:nlist]].clone()
    rng = np.random.default_rng(seed)
    rows = quantize_rows(x)
    for _ in range(iters):
        labels, sums = _assign_and_sum(x, centroids, by, rows)
        counts = torch.bincount(labels, minlength=nlist)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None].float()
        if not bool(filled.all()):
            _split_empty(centroids, counts.numpy().copy(), rng)
    return centroids


def _split_empty(centroids: torch.Tensor, counts: np.ndarray, rng: np.random.Generator) -> None:
    """Gives every empty list (``counts [K]``) a centroid of its own, in place, as faiss's
    ``split_clusters`` does: a list drawn with odds by its size beyond one lends a copy of its
    centroid, and the two move apart by ``SPLIT_EPS`` in alternate directions per dimension."""
    sign = torch.ones(centroids.shape[1])
    sign[1::2] = -1
    counts = counts.astype(np.float64)
    for ci in np.flatnonzero(counts == 0):
        spare = np.maximum(counts - 1, 0)
        cj = int(rng.choice(len(counts), p=spare / spare.sum()))
        centroids[ci] = centroids[cj] * (1 + SPLIT_EPS * sign)
        centroids[cj] *= 1 - SPLIT_EPS * sign
        counts[ci] = counts[cj] // 2
        counts[cj] -= counts[ci]


def _flat(d: int, by: str) -> faiss.Index:
    return faiss.IndexFlatIP(d) if by == "ip" else faiss.IndexFlatL2(d)


def _explain_small(n: int, nlist: int) -> None:
    """Logs once per (n, nlist) that k-means has fewer points per list than faiss asks for."""
    if nlist <= 1 or n >= nlist * MIN_POINTS_PER_CENTROID or (n, nlist) in _explained:
        return
    _explained.add((n, nlist))
    log.warning(
        "k-means of %d vectors into nlist = %d lists: %.1f per list, fewer than the %d faiss "
        "asks for, so centroids are noisy (the index still works; nprobe is tuned for recall). "
        "Leave [model.index] nlist unset for %d lists on this catalog, or lower it.",
        n, nlist, n / nlist, MIN_POINTS_PER_CENTROID, default_nlist(n),
    )  # fmt: skip


def assign(x: torch.Tensor, centroids: torch.Tensor, by: str = "l2") -> torch.Tensor:
    """The list of every row by ``by`` ("l2": nearest centroid, "ip": largest x·c):
    ``x [N, D]`` -> ``[N] int64``."""
    if int8_assigns():
        return nearest(_as_rows(x), _as_rows(centroids), by)[0]
    quantizer = _flat(centroids.shape[1], by)
    quantizer.add(_as_rows(centroids).numpy())
    _, nearest_ = quantizer.search(_as_rows(x).numpy(), 1)
    return torch.from_numpy(nearest_[:, 0]).long()
