"""Fused pooled lookups for inference: many features' ``ids [B, L]`` -> ``[B, D]`` in one call.

:class:`~sharded_tables.collection.EmbeddingCollection` pools with ``nn.EmbeddingBag`` when it
trains (gradients flow to the tables); without gradients on CPU it calls this kernel instead
(``csrc/pooled_lookup.cpp``, built on first use like the scan kernel): the same sums, one C++
call for all features instead of ~10 small torch ops each, which is most of the tables' cost for
a serving batch of a few users. Registered as the ``recserve::pooled_lookup`` op with a fake
implementation, so ``torch.compile`` traces through it.

Example::

    out = pooled_lookup([weight], [torch.tensor([[3, 7, -1]])], [True])
    out[0]  # [1, D]: (weight[3] + weight[7]) / 2
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from common.cpp_extension import load_extension
from sharded_tables.specs import DType

_SRC = Path(__file__).parent / "csrc" / "pooled_lookup.cpp"


def _extension() -> ModuleType:
    """Builds (once per source version, cached on disk) and loads the C++ kernel."""
    return load_extension("recserve_pooled_lookup", _SRC, ("-O3", "-march=native"), ())


def build_kernel() -> None:
    """Compiles the C++ kernel now, if not cached (``recserve kernels``)."""
    _extension()


@torch.library.custom_op("recserve::pooled_lookup", mutates_args=())
def _pooled_lookup_op(
    weights: list[torch.Tensor], ids: list[torch.Tensor], mean: list[bool]
) -> list[torch.Tensor]:
    return list(_extension().pooled_lookup(weights, ids, mean))


@_pooled_lookup_op.register_fake
def _(weights, ids, mean):
    return [w.new_empty((i.shape[0], w.shape[1])) for w, i in zip(weights, ids, strict=True)]


def pooled_lookup(
    weights: list[torch.Tensor], ids: list[torch.Tensor], mean: list[bool]
) -> list[torch.Tensor]:
    """Per feature ``f``: rows of ``weights[f] float32 [R, D]`` (contiguous, CPU) at the
    present ids of ``ids[f] int64 [B, L]`` (``-1``: none), summed, divided by their count when
    ``mean[f]`` -> ``float32 [B, D]`` (zeros where no id is present). Raises on an id outside
    ``[-1, R)``. Not differentiable: for inference only."""
    if torch.compiler.is_compiling():
        return _pooled_lookup_op(weights, ids, mean)
    # eager callers skip the op dispatcher (tens of microseconds a call)
    return list(_extension().pooled_lookup(weights, ids, mean))


PACKED_DTYPES = (DType.FP32, DType.FP16, DType.FP8, DType.INT8, DType.INT4)
"""Packed dtypes by their code in ``csrc/pooled_lookup.cpp``."""


def pool_cached(
    storage: torch.Tensor,
    slots: torch.Tensor,
    fetched: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    widths: list[int],
    batch: int,
    mean: bool,
    dtype: DType,
    dim: int,
) -> list[torch.Tensor]:
    """Pooled rows of a hot-row cache (CPU; :mod:`sharded_tables.remote_tier`'s batches).

    A batch's distinct ids have their packed rows (``dtype``, width ``dim``; the layout of
    :mod:`sharded_tables.quantize`) in ``storage uint8 [C, row_bytes]`` at ``slots int64 [U]``,
    or, where the slot is ``-1``, in ``fetched uint8 [M, row_bytes]`` (the misses, in order).
    ``ids int64 [n]`` are every feature's ``[B, L_f]`` ids end to end (``-1``: none, ``B`` =
    ``batch``, ``L_f`` = ``widths[f]``) and ``positions int64 [n]`` each id's index among the
    distinct ids. Returns per feature ``float32 [B, dim]``: the decoded rows summed (``mean``:
    divided by the present count) as :func:`pooled_lookup` sums. Raises on a slot, position or
    row count out of range.
    """
    code = PACKED_DTYPES.index(DType(dtype))
    ext = _extension()
    return list(
        ext.pool_cached(storage, slots, fetched, ids, positions, widths, batch, mean, code, dim)
    )
