"""Building an :class:`IVFIndex`: k-means, list assignment, residual codes, filter signatures,
postings, and (optionally) nprobe tuned for a target recall against exact search."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from retrieval.filters import bit_counts
from retrieval.index.codes import quantize
from retrieval.index.exact import recall_at_k
from retrieval.index.ivf import EXACT_DTYPES, IVFConfig, IVFIndex
from retrieval.index.kmeans import assign, train_centroids


def build_ivf(
    vectors: torch.Tensor,
    config: IVFConfig | None = None,
    *,
    item_ids: torch.Tensor | None = None,
    item_attributes: Mapping[str, np.ndarray] | None = None,
    attribute_values: Mapping[str, Sequence[str]] | None = None,
    tune_queries: torch.Tensor | None = None,
) -> IVFIndex:
    """Builds an :class:`IVFIndex` over ``vectors [N, D] float32``.

    ``item_ids [N] int64`` defaults to ``0..N-1``; ``item_attributes`` (codes ``[N]`` or bool
    ``[N, V]`` per attribute, vocabularies in ``attribute_values``) become filter signatures.
    With ``config.target_recall`` set, nprobe is tuned on ``tune_queries [Q, D]`` (default: a
    sample of the vectors themselves).
    """
    config = config or IVFConfig()
    config.validate()
    if vectors.dim() != 2 or vectors.shape[0] < 1:
        raise ValueError(f"vectors must be [N >= 1, D], got {tuple(vectors.shape)}")
    n, d = vectors.shape
    x = vectors.detach().cpu().float().contiguous()
    ids = torch.arange(n) if item_ids is None else item_ids.detach().cpu().long()
    if ids.shape != (n,):
        raise ValueError(f"item_ids must be [N={n}], got {tuple(ids.shape)}")
    if item_attributes and not attribute_values:
        raise ValueError("attribute_values is required with item_attributes")
    index = IVFIndex(config, d, attribute_values)
    nlist = min(config.nlist, n)
    centroids = train_centroids(
        x,
        nlist,
        iters=config.kmeans_iters,
        seed=config.seed,
        max_points_per_centroid=config.kmeans_max_points_per_centroid,
    )
    lists = assign(x, centroids)
    order = torch.argsort(lists, stable=True)
    counts = torch.bincount(lists, minlength=nlist)
    xs, ls = x[order], lists[order]
    codes, scales = quantize(xs - centroids[ls], config.codes)
    sig = index.schema.signatures(item_attributes or {}, n)[order]
    index.centroids = centroids
    index.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    index.item_ids = ids[order].contiguous()
    index.codes, index.scales = codes.contiguous(), scales.contiguous()
    exact_dtype = EXACT_DTYPES[config.exact_copy]
    index.exact = xs.to(exact_dtype) if exact_dtype is not None else torch.zeros(0, d)
    index.sig = sig.contiguous()
    index.bit_counts = bit_counts(sig) if sig.shape[1] else torch.zeros(0, dtype=torch.int64)
    index.postings = postings(sig)
    index._refresh()
    if config.target_recall > 0:
        tune_nprobe(
            index,
            x[torch.randperm(n, generator=torch.Generator().manual_seed(config.seed))[:256]]
            if tune_queries is None
            else tune_queries.float().cpu(),
        )
    return index


def postings(sig: torch.Tensor) -> torch.Tensor:
    """Items of every signature bit, bit after bit: ``sig [N, W]`` -> ``[nnz] int32``."""
    if sig.shape[1] == 0:
        return torch.zeros(0, dtype=torch.int32)
    if sig.shape[0] >= 2**31:
        raise ValueError("postings hold int32 positions: at most 2**31 - 1 items per index")
    shifts = torch.arange(64)
    out = []
    for w in range(sig.shape[1]):  # one word at a time bounds the [N, 64] temporary
        bits = ((sig[:, w : w + 1] >> shifts) & 1).bool()  # [N, 64]
        out.append(bits.T.nonzero()[:, 1].to(torch.int32))  # sorted by bit, then item
    return torch.cat(out)


def tune_nprobe(index: IVFIndex, queries: torch.Tensor) -> int:
    """Sets ``index.config.nprobe`` to the smallest power of two (or nlist) whose unfiltered
    recall@``tune_k`` against exact search on ``queries [Q, D]`` reaches ``target_recall``."""
    cfg = index.config
    k = min(cfg.tune_k, index.ntotal)
    truth_pos, _ = index.search_positions(
        queries, k, index.schema.empty(len(queries)), 1, cfg.rerank, exact=True
    )
    nprobe = 1
    while True:
        pos, _ = index.search_positions(
            queries, k, index.schema.empty(len(queries)), nprobe, cfg.rerank
        )
        if nprobe >= index.nlist or recall_at_k(pos, truth_pos) >= cfg.target_recall:
            break
        nprobe = min(2 * nprobe, index.nlist)
    index.config = replace(cfg, nprobe=nprobe)
    return nprobe
