"""The peers our index is measured against, configured per ``/work/shared/ANCHORS.md``.

* faiss ``IndexFlatIP`` (exact; also the ground truth);
* faiss ``IVF{nlist},SQ8`` and ``IVF{nlist},Flat`` (inner product) sharing one trained coarse
  quantizer, searched with ``SearchParametersIVF(nprobe=..., sel=IDSelectorBitmap)`` when filtered;
* an exact scan of a filter's eligible ids in torch: gather the rows, one matmul, ``topk``.

Shapes: items ``x [N, D] float32``, queries ``q [B, D] float32``, results ``[B, K] int64`` (-1 pads).

Example::

    ivfs, kmeans_s = build_faiss_ivfs(x, nlist=1024, train_size=256 * 1024)
    sq8 = ivfs["faiss-IVF-SQ8"].index
    ids = faiss_search(sq8, q, 100, ivf_params(nprobe=32, sel=bitmap_selector(keep)))
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np
import torch
from timing import stopwatch

# faiss-cpu 1.15.1 ships 128000; batched exact search below it runs faiss's slow per-query loop.
DEFAULT_BLAS_THRESHOLD = faiss.cvar.distance_compute_blas_threshold
TRAIN_SEED = 3


def faiss_search(
    index: faiss.Index, q: np.ndarray, k: int, params: faiss.SearchParameters | None = None
) -> np.ndarray:
    """``q [B, D]`` -> ids ``[B, k] int64``.

    Fairness (ANCHORS): batches (B >= 4) get faiss's BLAS path by lowering the threshold to 1;
    single queries keep the shipped default, faiss's fastest path for one query.
    """
    faiss.cvar.distance_compute_blas_threshold = 1 if len(q) >= 4 else DEFAULT_BLAS_THRESHOLD
    _, ids = index.search(q, k, params=params)
    return ids


def ivf_params(nprobe: int, sel: faiss.IDSelector | None = None) -> faiss.SearchParametersIVF:
    """Per-call IVF parameters; build once per setting so the timed loop does not pay for it."""
    if sel is None:
        return faiss.SearchParametersIVF(nprobe=nprobe)
    return faiss.SearchParametersIVF(nprobe=nprobe, sel=sel)


def bitmap_selector(keep: np.ndarray) -> faiss.IDSelectorBitmap:
    """``keep [N] bool`` -> an ``IDSelectorBitmap`` (bit ``i % 8`` of byte ``i // 8``, little order).

    The wrapper keeps a reference to the packed array, so it lives as long as the selector.
    """
    return faiss.IDSelectorBitmap(np.packbits(keep, bitorder="little"))


def bytes_per_item(index: faiss.Index, n: int) -> float:
    """Serialized size of the whole index (codes, ids, centroids, SQ ranges) divided by ``n``."""
    return len(faiss.serialize_index(index)) / n


def flat_index(x: np.ndarray) -> faiss.IndexFlatIP:
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    return index


@dataclass
class FaissBuild:
    """A built faiss index and the seconds spent on it (coarse k-means is counted separately)."""

    index: faiss.Index
    build_s: float


def build_faiss_ivfs(
    x: np.ndarray, nlist: int, train_size: int
) -> tuple[dict[str, FaissBuild], float]:
    """Train one coarse quantizer (k-means) and build ``IVF{nlist},SQ8`` and ``IVF{nlist},Flat``.

    Both indexes share the centroids so their difference is only the codes. Training uses a
    random sample of ``train_size`` items (all of them if fewer). Returns ``(builds, kmeans_s)``.
    """
    n, d = x.shape
    sample = x
    if train_size < n:
        pick = np.random.default_rng(TRAIN_SEED).choice(n, size=train_size, replace=False)
        sample = np.ascontiguousarray(x[np.sort(pick)])

    elapsed = stopwatch()
    flat = faiss.index_factory(d, f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT)
    flat.train(sample)
    kmeans_s = elapsed()
    centroids = faiss.extract_index_ivf(flat).quantizer.reconstruct_n(0, nlist)
    elapsed = stopwatch()
    flat.add(x)
    builds = {"faiss-IVF-Flat": FaissBuild(flat, elapsed())}

    elapsed = stopwatch()
    sq8 = faiss.index_factory(d, f"IVF{nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
    # A trained, full quantizer makes IndexIVF.train skip k-means and train only the SQ ranges.
    faiss.extract_index_ivf(sq8).quantizer.add(centroids)
    sq8.train(sample)
    sq8.add(x)
    builds["faiss-IVF-SQ8"] = FaissBuild(sq8, elapsed())
    return builds, kmeans_s


class EligibleScan:
    """Exact top-K over a filter's eligible ids: gather the rows, one matmul, ``topk`` (torch).

    x: ``[N, D] float32``. The score matrix is built in query chunks of at most
    ``max_scores`` floats so 50 % selectivity at 1M items does not allocate gigabytes.
    """

    def __init__(self, x: torch.Tensor, max_scores: int = 1 << 25) -> None:
        assert x.dim() == 2 and x.dtype == torch.float32
        self.x = x
        self.max_scores = max_scores

    @torch.inference_mode()
    def search(self, q: torch.Tensor, k: int, eligible: torch.Tensor) -> np.ndarray:
        """``q [B, D]``, ``eligible [M] int64`` -> ids ``[B, k] int64`` (-1 pads when ``M < k``)."""
        xs = self.x.index_select(0, eligible)  # (M, D) gather
        b, m = q.shape[0], xs.shape[0]
        out = torch.full((b, k), -1, dtype=torch.int64)
        kk = min(k, m)
        step = max(1, self.max_scores // max(m, 1))
        for s in range(0, b, step):
            scores = q[s : s + step] @ xs.T  # (b', M)
            top = scores.topk(kk, dim=1).indices  # (b', kk)
            out[s : s + step, :kk] = eligible[top]
        return out.numpy()
