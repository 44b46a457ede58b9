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
    if type(value) is int and value >= minimum:  # the common call: no ABC check (~1 us)
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
