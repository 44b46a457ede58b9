"""The index's public edges: what callers may pass, turned into what the hot path trusts.

Arrays may be torch tensors or NumPy arrays (``np.ndarray``: converted without a copy when the
dtype allows); counts (``k``, ``nprobe``, ``rerank``) may be any integral value (``int``,
``np.int64``, ...) but not a ``bool`` (``True`` is an ``int`` in Python, and ``k=True`` is a
mistake, not a request for one item). Errors name the argument and say what to pass instead.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any

import numpy as np
import torch

from retrieval.filters import FilterBatch
from retrieval.index.plan import SearchParams


def as_tensor(value: Any, field: str) -> torch.Tensor:
    """A ``torch.Tensor`` or ``np.ndarray`` -> ``torch.Tensor`` (same dtype and shape)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object or value.dtype.kind in "USV":
            raise ValueError(f"{field}: expected a numeric array, got dtype {value.dtype}")
        return torch.from_numpy(np.ascontiguousarray(value))
    raise ValueError(
        f"{field}: expected a torch.Tensor or numpy.ndarray, got {type(value).__name__} "
        f"(wrap lists with torch.tensor(...) or np.asarray(...))"
    )


def as_count(value: Any, field: str, minimum: int, hint: str = "") -> int:
    """An integral ``value >= minimum`` -> ``int``; bools, floats and smaller values refused
    (``hint`` ends the message)."""
    if (
        type(value) is int and value >= minimum
    ):  # the common call: no ABC check, which costs more than the call
        return value
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{field}: expected an integer >= {minimum}, got {value!r}{hint}")
    out = operator.index(value)
    if out < minimum:
        raise ValueError(f"{field}: expected an integer >= {minimum}, got {out}{hint}")
    return out


def as_optional_count(value: Any, field: str, minimum: int, default: int, hint: str = "") -> int:
    """:func:`as_count`, with ``None`` meaning ``default`` (the index's configured value)."""
    return default if value is None else as_count(value, field, minimum, hint)


def as_queries(q: Any, dim: int, device: torch.device) -> torch.Tensor:
    """Queries ``[B, dim]`` floats (tensor or NumPy) -> float32 on ``device``."""
    if (
        type(q) is torch.Tensor
        and q.dtype is torch.float32
        and q.device == device
        and q.dim() == 2
        and q.shape[1] == dim
    ):
        return q  # the common call, as it is (even a no-op .to() dispatches)
    q = as_tensor(q, "q")
    if q.dim() != 2 or q.shape[1] != dim or not q.is_floating_point():
        raise ValueError(
            f"q: expected floats [B, {dim}], got {tuple(q.shape)} {q.dtype}"
            + (" (cast with .float() / .astype(np.float32))" if q.dim() == 2 else "")
        )
    return q.to(device, torch.float32)


def check_filter_batch(fb: FilterBatch, batch: int, words: int) -> None:
    """A compiled filter for ``batch`` rows over ``words`` signature words: ``masks [B, C, W]``
    and, when given, ``exclude [B, S]`` int64 item ids (``-1`` pads); ``ValueError`` otherwise."""
    if fb.masks.dim() != 3 or fb.masks.shape[0] != batch or fb.masks.shape[2] != words:
        raise ValueError(
            f"filters: expected masks [B={batch}, C, W={words}], got {tuple(fb.masks.shape)}"
        )
    nm = fb.neg_masks
    if nm is not None and (nm.shape != fb.masks.shape or nm.dtype != torch.int64):
        raise ValueError(
            f"filters.neg_masks: expected int64 {tuple(fb.masks.shape)}, got {nm.dtype} "
            f"{tuple(nm.shape)}"
        )
    ex = fb.exclude
    if ex is not None and (ex.dim() != 2 or ex.shape[0] != batch or ex.dtype != torch.int64):
        raise ValueError(
            f"filters.exclude: expected int64 item ids [B={batch}, S], got {ex.dtype} "
            f"{tuple(ex.shape)}"
        )
    if ex is not None and ex.numel() and int(ex.min()) < -1:
        raise ValueError(f"filters.exclude: item ids are >= 0 (-1 pads), got {int(ex.min())}")


def filters_on(fb: FilterBatch, device: torch.device) -> FilterBatch:
    """``fb`` on ``device``: as it is where its tensors are there already (a compiled batch
    passed to every search would otherwise be copied, a no-op per tensor, each call)."""
    ex = fb.exclude
    here = fb.masks.device == device and fb.negate.device == device
    here = here and (fb.neg_masks is None or fb.neg_masks.device == device)
    return fb if here and (ex is None or ex.device == device) else fb.to(device)


def search_params(
    default_nprobe: int,
    default_rerank: int,
    keeps_exact_copy: bool,
    ntotal: int,
    k: Any,
    nprobe: Any = None,
    rerank: Any = None,
    exact: bool = False,
    target: torch.Tensor | None = None,
) -> SearchParams:
    """The checked settings of a search of an index of ``ntotal`` items: ``k`` in [1, ntotal],
    ``nprobe`` / ``rerank`` (None: the defaults), a re-rank only where the index keeps an exact
    copy, ``target [B]`` recall targets (checked by the caller)."""
    if type(nprobe) is int and nprobe >= 1:  # the common call: no message made
        nprobe_ = nprobe
    else:
        hint = f"; leave it out (None) to probe the index's nprobe ({default_nprobe})"
        nprobe_ = as_optional_count(nprobe, "nprobe", 1, default_nprobe, hint)
    rerank_ = as_optional_count(rerank, "rerank", 0, default_rerank)
    if rerank is not None and rerank_ > 0 and not keeps_exact_copy:
        raise ValueError(
            f"rerank={rerank_}: this index keeps no exact copy to re-rank with "
            f'(exact_copy="none"); build it with rerank > 0 or exact_copy="float16", '
            "or search with rerank=0"
        )
    k_ = as_count(k, "k", 1)
    if k_ > ntotal:
        raise ValueError(f"k: at most {ntotal} (the catalog size), got {k_}")
    return SearchParams(k_, nprobe_, rerank_, bool(exact), target)
