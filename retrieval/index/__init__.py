"""The item index held as tensors: IVF lists of INT8/FP8 residual codes, exact re-rank, filters.

The names below load on first use, so that ``retrieval.index.config`` (what ``train.toml``'s
``[model.index]`` is) imports without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from retrieval.index.build import build_ivf
    from retrieval.index.exact import exact_search, recall_at_k
    from retrieval.index.ivf import IVFConfig, IVFIndex

__all__ = ["IVFConfig", "IVFIndex", "build_ivf", "exact_search", "recall_at_k"]
_HOME = {
    "IVFConfig": "retrieval.index.config",
    "IVFIndex": "retrieval.index.ivf",
    "build_ivf": "retrieval.index.build",
    "exact_search": "retrieval.index.exact",
    "recall_at_k": "retrieval.index.exact",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'retrieval.index' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
