"""The item index held as tensors: IVF lists of INT8/FP8 residual codes, exact re-rank, filters."""

from retrieval.index.build import build_ivf
from retrieval.index.exact import exact_search, recall_at_k
from retrieval.index.ivf import IVFConfig, IVFIndex

__all__ = ["IVFConfig", "IVFIndex", "build_ivf", "exact_search", "recall_at_k"]
