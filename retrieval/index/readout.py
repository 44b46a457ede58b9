"""Reading rows of an index back: their item ids, their vectors and queries' scores against them.

Free functions over :class:`~retrieval.index.tensors.IndexTensors`, shared by the exact scan, the
re-rank, a scoring head's candidates and the one-call backends. On the CPU over int8 codes the
rows are read in C++ passes that skip the gathered float copy of the codes; elsewhere torch ops.
"""

from __future__ import annotations

import torch

from retrieval.index.codes import dequantize
from retrieval.index.probe import FEW_QUERIES
from retrieval.index.scan import (
    centroid_dots_cpu,
    decode_rows_cpu,
    ids_of_positions_cpu,
    many_rows_cpu,
    score_rows_cpu,
)
from retrieval.index.tensors import IndexTensors


def ids_at(t: IndexTensors, pos: torch.Tensor) -> torch.Tensor:
    """Positions ``[B, k]`` (-1 pads) -> item ids (-1 pads): one C++ pass on the CPU (torch
    ops on a GPU and in a trace)."""
    if pos.is_cpu and t.item_ids.is_cpu and not torch.compiler.is_compiling():
        return ids_of_positions_cpu(pos, t.item_ids)
    return torch.where(pos >= 0, t.item_ids[pos.clamp(min=0)], pos)


def scores_at(t: IndexTensors, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``q [B, D]`` float32 scored against rows ``pos [M]`` -> ``[B, M]``: with the exact copy,
    else read off the codes as ``q·code * scale + q·centroid``. On the CPU over int8 codes: a
    few queries in one C++ pass over the codes with the float query; more, the list scan's
    scores (the query quantized) from one int8 GEMM (:func:`~retrieval.index.scan.many_rows_cpu`).
    Otherwise the rows decoded once, then a matmul."""
    if t.exact.shape[0]:
        return q @ t.exact.index_select(0, pos).float().T
    if q.is_cpu and t.lists.codes.dtype == torch.int8:  # as the exact C++ call's
        if len(q) > FEW_QUERIES:
            return many_rows_cpu(q, pos, t.lists, t.centroids_t)
        return score_rows_cpu(q, pos, t.lists, centroid_dots_cpu(q, t.centroids_t))
    # decode the M rows once (centroid + scale * code) and take one matmul, rather than
    # scaling and shifting [B, M] scores (B x M > M x D once B passes D)
    return q @ vectors_at(t, pos).T


def vectors_at(t: IndexTensors, pos: torch.Tensor) -> torch.Tensor:
    """Float vectors of rows ``pos [M]`` from the exact copy, else decoded from the codes (one
    C++ pass on the CPU; torch ops on a GPU and in a trace)."""
    if t.exact.shape[0]:
        return t.exact.index_select(0, pos).float()
    lists = t.lists
    if pos.is_cpu and lists.codes.dtype == torch.int8 and not torch.compiler.is_compiling():
        return decode_rows_cpu(pos, lists, t.centroids_t)
    listed = torch.searchsorted(lists.offsets, pos, right=True) - 1
    codes, scales = lists.codes.index_select(0, pos), lists.scales.index_select(0, pos)
    return t.centroids.index_select(0, listed) + dequantize(codes, scales)
