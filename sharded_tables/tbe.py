"""Local tiers (device / host): many packed tables read by one table-batched kernel call.

``LocalTables`` holds the packed rows of every table placed in this process and pools the ids
of all features in **one** call of fbgemm's ``IntNBitTableBatchedEmbeddingBagsCodegen`` (mixed
dtypes in one call), the inference kernel that TorchRec's quantized modules use.

Input is jagged, as a KeyedJaggedTensor: ``indices [sum of lengths]`` and
``offsets [F * B + 1]`` over features in :attr:`feature_names` order, feature-major;
output is ``[B, sum of D]`` with each feature's slice pooled (sum, or mean for mean tables).

Backends, chosen at construction:

* ``fbgemm``: CPU always (``EmbeddingLocation.HOST``), and CUDA when the installed fbgemm-gpu
  has CUDA kernels (device tier ``DEVICE``, host tier ``MANAGED_CACHING``: UVM with an HBM cache).
* ``torch``: packed rows on the device (device tier) or in pinned host memory (host tier), read
  by unique-id gather -> :func:`unpack_rows` -> ``embedding_bag``. Used on CUDA when fbgemm-gpu
  is the CPU build; the same numbers as the kernel (tested against it on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from common.compile_boundary import eager_under_compile
from sharded_tables.device_cache import DeviceRowCache
from sharded_tables.quantize import pack_rows, unpack_rows
from sharded_tables.specs import FP8_EXPONENT_BIAS, FP8_EXPONENT_BITS, DType, row_bytes


@dataclass(frozen=True)
class LocalTable:
    """A table placed in this process."""

    name: str
    rows: int
    dim: int
    dtype: DType
    features: tuple[str, ...]
    pooling: str = "mean"
    cache_rows: int = 0
    """Host tier, torch backend: rows of the table kept on the device (:class:`DeviceRowCache`,
    pooled with those of the tables sharing its row store); ignored elsewhere."""


@dataclass
class _Group:
    """Torch backend: the tables of one (dtype, dim) in one row store."""

    dtype: DType
    dim: int
    store: torch.Tensor  # uint8 [sum of rows, row_bytes]
    features: list[int]  # feature positions read from this store
    base: list[int]  # first store row of each feature's table
    cache: DeviceRowCache | None = None  # host tier: hot rows on the device
    base_t: torch.Tensor | None = None  # ``base`` on the device [F_g] (made once, not per call)


def fbgemm_installed() -> bool:
    """True when fbgemm-gpu (CPU or CUDA build) imports here."""
    try:
        import fbgemm_gpu  # noqa: F401
    except ImportError:
        return False
    return True


def fbgemm_has_cuda() -> bool:
    """True when fbgemm-gpu's inference TBE kernel is built for CUDA here."""
    if not torch.cuda.is_available():
        return False
    try:
        import fbgemm_gpu  # noqa: F401

        return torch._C._dispatch_has_kernel_for_dispatch_key(
            "fbgemm::int_nbit_split_embedding_codegen_lookup_function", "CUDA"
        )
    except (ImportError, RuntimeError):
        return False


def jagged_from_padded(
    features: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded id matrices ``[B, L_f]`` (-1 = none) -> (indices, offsets ``[F*B+1]``, lengths ``[F, B]``)."""
    present = [ids >= 0 for ids in features]
    lengths = torch.stack([p.sum(dim=1) for p in present])  # [F, B]
    indices = torch.cat([ids[p] for ids, p in zip(features, present, strict=True)])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.flatten(), 0, out=offsets[1:])
    return indices, offsets, lengths


class LocalTables(nn.Module):
    """Pooled lookups over packed tables of one tier: jagged ids -> ``[B, sum of D]``."""

    def __init__(
        self,
        tables: list[LocalTable],
        tier: str = "host",
        device: torch.device | str = "cpu",
        backend: str | None = None,
        cache_policy: str = "hybrid",
        cache_admit_after: int = 2,
    ):
        """``cache_policy`` / ``cache_admit_after``: eviction policy and admission threshold of
        the host tier's device caches (tables with ``cache_rows``, torch backend)."""
        super().__init__()
        self._cache_policy, self._cache_admit_after = cache_policy, cache_admit_after
        if tier not in ("device", "host"):
            raise ValueError(f"tier must be 'device' or 'host', got {tier!r}")
        self.tables = list(tables)
        self.tier = tier
        self.device = torch.device(device)
        self.feature_names: list[str] = []
        self.feature_table: list[int] = []
        for t_index, t in enumerate(self.tables):
            row_bytes(t.dim, t.dtype)
            for f in t.features:
                if f in self.feature_names:
                    raise ValueError(f"feature {f!r} is assigned to two tables")
                self.feature_names.append(f)
                self.feature_table.append(t_index)
        dims = [self.tables[t].dim for t in self.feature_table]
        self.feature_dims = dims
        mean = [self.tables[t].pooling == "mean" for t in self.feature_table]
        self._mean = torch.tensor(mean, dtype=torch.bool, device=self.device)  # [F]
        self._any_mean = any(mean)
        self._mean_np = np.array(mean, bool)  # [F], for the eager host path
        self._equal_dims = len(set(dims)) == 1
        self._has_fp8 = any(t.dtype is DType.FP8 for t in self.tables)
        self._offsets_cache: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self._bags_cache: dict[tuple[Any, ...], torch.Tensor] = {}
        self._dims = torch.tensor(dims, device=self.device)  # [F]
        if backend is None:
            on_cpu = self.device.type == "cpu" and fbgemm_installed()
            backend = "fbgemm" if on_cpu or fbgemm_has_cuda() else "torch"
        self.backend = backend
        self._tbe: Any = None  # fbgemm IntNBitTableBatchedEmbeddingBagsCodegen
        self._packed: list[torch.Tensor] = []
        self._no_cache_locations = torch.empty(0, dtype=torch.int32, device=self.device)
        if backend == "fbgemm":
            self._tbe = self._make_tbe()
        elif backend == "torch":
            self._groups = self._make_groups()
        else:
            raise ValueError(f"backend must be 'fbgemm' or 'torch', got {backend!r}")

    # ---- storage --------------------------------------------------------------------------
    def _make_tbe(self) -> Any:
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
            IntNBitTableBatchedEmbeddingBagsCodegen,
        )

        if self.device.type == "cpu":
            location = EmbeddingLocation.HOST
        else:
            location = (
                EmbeddingLocation.DEVICE
                if self.tier == "device"
                else EmbeddingLocation.MANAGED_CACHING
            )
        tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[
                (t.name, t.rows, t.dim, SparseType(t.dtype.value), location) for t in self.tables
            ],
            feature_table_map=self.feature_table,
            pooling_mode=PoolingMode.SUM,  # mean is a division by lengths after the call
            device=self.device,
            bounds_check_mode=BoundsCheckMode.NONE,  # ids are checked at the edge (validate)
            output_dtype=SparseType.FP32,
            fp8_exponent_bits=FP8_EXPONENT_BITS,
            fp8_exponent_bias=FP8_EXPONENT_BIAS,
            indices_dtype=torch.int64,
        )
        tbe.initialize_weights()
        return tbe

    def _make_groups(self) -> list[_Group]:
        """Torch backend: tables of one (dtype, dim) share one row store (as TBE weights do), so
        all their features are one gather; ``_packed[i]`` is table i's slice of it."""
        groups: list[_Group] = []
        pinned = self.device.type == "cuda" and self.tier == "host"
        self._packed = [torch.empty(0)] * len(self.tables)
        self._place: dict[int, tuple[_Group, int]] = {}  # table -> (its store, first row)
        for dtype, dim in dict.fromkeys((t.dtype, t.dim) for t in self.tables):
            members = [i for i, t in enumerate(self.tables) if (t.dtype, t.dim) == (dtype, dim)]
            rows = sum(self.tables[i].rows for i in members)
            store = torch.zeros(rows, row_bytes(dim, dtype), dtype=torch.uint8)
            store = store.pin_memory() if pinned else store.to(self.device)
            first_row, start = {}, 0
            for i in members:
                first_row[i] = start
                self._packed[i] = store[start : start + self.tables[i].rows]
                start += self.tables[i].rows
            feats = [j for j, t in enumerate(self.feature_table) if t in members]
            base = [first_row[self.feature_table[j]] for j in feats]
            g = _Group(dtype, dim, store, feats, base, self._cache_for(store, members, dtype, dim))
            g.base_t = torch.tensor(base, device=self.device)
            groups.append(g)
            for i in members:
                self._place[i] = (g, first_row[i])
        return groups

    def _cache_for(
        self, store: torch.Tensor, members: list[int], dtype: DType, dim: int
    ) -> DeviceRowCache | None:
        """A host store's device cache, sized by its tables' ``cache_rows`` (None: none)."""
        rows = sum(self.tables[i].cache_rows for i in members)
        if self.tier != "host" or rows == 0:
            return None
        name = f"{self.tier}/{dtype.value}/{dim}"
        policy, admit = self._cache_policy, self._cache_admit_after
        return DeviceRowCache(store, rows, self.device, policy, admit, name=name)

    def _read(self, g: _Group, rows: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """Packed rows ``uint8 [n, row_bytes]`` on the device of store rows ``rows [n]`` (in
        range) of group ``g``; ``present bool [n]``: which are real ids (the cache logs those)."""
        if g.cache is not None:
            return g.cache.read(rows, present)
        return g.store[rows.to(g.store.device)].to(self.device, non_blocking=True)

    def admit_cached(self) -> int:
        """Between batches: each device cache admits the rows its lookups missed -> rows
        admitted (0 without caches)."""
        return sum(g.cache.admit() for g in getattr(self, "_groups", []) if g.cache is not None)

    def cache_stats(self) -> dict[str, dict[str, float]]:
        """``{cache name: counters}`` of the device caches (:meth:`DeviceRowCache.stats`)."""
        return {
            g.cache.policy.name: g.cache.stats()
            for g in getattr(self, "_groups", [])
            if g.cache is not None
        }

    def rows_written(self, name: str, rows: torch.Tensor) -> None:
        """Table ``name``'s rows ``rows int64 [n]`` were rewritten (through :meth:`rows_view`):
        a device cache forgets its copies of them."""
        if self._tbe is None:
            g, first = self._place[self._index(name)]
            if g.cache is not None:
                g.cache.invalidate(rows.cpu() + first)

    def _index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise KeyError(f"unknown table {name!r} (local: {[t.name for t in self.tables]})")

    def set_packed(self, name: str, packed: torch.Tensor) -> None:
        """Replaces table ``name``'s rows with packed rows ``uint8 [rows, row_bytes]``."""
        i = self._index(name)
        t = self.tables[i]
        expect = (t.rows, row_bytes(t.dim, t.dtype))
        if packed.dtype != torch.uint8 or tuple(packed.shape) != expect:
            raise ValueError(
                f"table {name!r}: expected uint8 {list(expect)} packed {t.dtype.value} rows, "
                f"got {packed.dtype} {list(packed.shape)}"
            )
        if self._tbe is not None:
            weights, scale_bias = self._tbe.split_embedding_weights()[i]
            if scale_bias is not None:
                scale_bias.copy_(packed[:, : packed.shape[1] - weights.shape[1]])
                weights.copy_(packed[:, scale_bias.shape[1] :])
            else:
                weights.copy_(packed)
        else:
            self._packed[i].copy_(packed)
            self.rows_written(name, torch.arange(t.rows))

    def rows_view(self, name: str) -> torch.Tensor:
        """Table ``name``'s packed rows ``uint8 [rows, row_bytes]`` as a writable view of what
        the kernel reads (a hot-row cache writes rows here and the kernel pools them by slot)."""
        i = self._index(name)
        t = self.tables[i]
        rb = row_bytes(t.dim, t.dtype)
        if self._tbe is None:
            return self._packed[i]
        if self.device.type != "cpu":
            raise NotImplementedError("row views of fbgemm's CUDA storage")
        weights, scale_bias = self._tbe.split_embedding_weights()[i]
        first = scale_bias if scale_bias is not None else weights
        assert first.stride(0) == rb, "the CPU kernel stores rows unpadded (row_alignment 1)"
        return self._tbe.weights_host.as_strided((t.rows, rb), (rb, 1), first.storage_offset())

    def packed(self, name: str) -> torch.Tensor:
        """Table ``name``'s packed rows ``uint8 [rows, row_bytes]`` (a CPU copy)."""
        i = self._index(name)
        if self._tbe is None:
            return self._packed[i].cpu().clone()
        weights, scale_bias = self._tbe.split_embedding_weights()[i]
        parts = [weights] if scale_bias is None else [scale_bias, weights]
        return torch.cat([p.cpu() for p in parts], dim=1)

    def set_float(self, name: str, weight: torch.Tensor) -> None:
        """Quantizes float rows ``[rows, D]`` into table ``name`` at its dtype."""
        self.set_packed(
            name, pack_rows(weight.detach().cpu(), self.tables[self._index(name)].dtype)
        )

    def bytes(self) -> int:
        """Bytes of packed rows held (excluding any kernel padding)."""
        return sum(t.rows * row_bytes(t.dim, t.dtype) for t in self.tables)

    # ---- lookup -----------------------------------------------------------------------------
    def forward_padded(self, features: list[torch.Tensor]) -> torch.Tensor:
        """Padded id matrices ``[B, L_f]`` (-1 = none), one per feature in :attr:`feature_names`
        order -> ``[B, sum of D]``. The towers' call; trusts its inputs.

        fbgemm's integer and float kernels skip id ``-1`` (pruned rows), so the padded matrix is
        the jagged input as is (offsets every ``L_f``); no mask-select pass over the ids. FP8
        tables take the kernel's generic path, which does not skip, so they go jagged.
        """
        b = features[0].shape[0]
        if self._tbe is not None and self.device.type == "cpu" and not self._has_fp8:
            offsets = self._padded_offsets(b, tuple(ids.shape[1] for ids in features))
            if not torch.compiler.is_compiling():
                return self._host_padded_eager(features, offsets)
            indices = torch.cat([ids.reshape(-1) for ids in features])
            out = self._host_kernel(indices, offsets)
            if self._any_mean:
                # ids present per bag from one prefix sum over the whole batch
                seen = torch.zeros(indices.numel() + 1, dtype=torch.int64)
                torch.cumsum(indices >= 0, 0, out=seen[1:])
                lengths = (seen[offsets[1:]] - seen[offsets[:-1]]).view(len(features), b)
                out = self._divide_means(out, lengths)
            return out
        if self._tbe is not None:
            indices, offsets, _ = jagged_from_padded(features)
            return self(indices, offsets)
        return self._torch_padded(features)

    def _host_padded_eager(
        self, features: list[torch.Tensor], offsets: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`forward_padded` on host weights outside ``torch.compile``: the ids and the
        mean divisors in NumPy on the kernel's tensors (a serving batch holds tens of ids, where
        each torch op's dispatch costs more than its work)."""
        mats = [ids.numpy() for ids in features]  # [B, L_f] each (CPU, inference)
        flat = np.concatenate([m.reshape(-1) for m in mats]) if len(mats) > 1 else mats[0].ravel()
        out = self._host_kernel(torch.from_numpy(flat), offsets)  # [B, sum of D], fresh
        if not self._any_mean:
            return out
        seen = np.zeros(len(flat) + 1, np.int64)  # ids present before each position
        np.cumsum(flat >= 0, out=seen[1:])
        offs = offsets.numpy()
        lengths = (seen[offs[1:]] - seen[offs[:-1]]).reshape(len(mats), -1)  # [F, B]
        div = np.where(self._mean_np[:, None], np.maximum(lengths, 1), 1).T  # [B, F]
        pooled = out.numpy()
        if self._equal_dims:
            view = pooled.reshape(len(div), len(mats), -1)  # [B, F, D]
            np.divide(view, div[:, :, None], out=view)
        else:
            pooled /= np.repeat(div, self.feature_dims, axis=1)
        return out

    def _padded_offsets(self, b: int, widths: tuple[int, ...]) -> torch.Tensor:
        """Offsets ``[F * B + 1]`` of padded matrices ``[B, L_f]`` laid end to end (cached)."""
        key = (b, widths)
        offsets = self._offsets_cache.get(key)
        if offsets is None:
            steps = torch.tensor([w for w in widths for _ in range(b)], dtype=torch.int64)
            offsets = torch.zeros(len(steps) + 1, dtype=torch.int64)
            torch.cumsum(steps, 0, out=offsets[1:])
            if len(self._offsets_cache) > 64:
                self._offsets_cache.clear()
            self._offsets_cache[key] = offsets
        return offsets

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Jagged ids (feature-major, :attr:`feature_names` order) -> ``[B, sum of D]``.

        Trusts its inputs: ids in range (``validate`` runs at the edge).
        """
        f = len(self.feature_names)
        b = (offsets.numel() - 1) // f
        if self._tbe is not None and self.device.type == "cpu":
            out = self._host_kernel(indices, offsets)
        elif self._tbe is not None:
            out = self._cuda_module(indices.to(self.device), offsets.to(self.device))
        else:
            return self._torch_lookup(indices, offsets, b)  # pools means itself
        if self._any_mean:
            out = self._divide_means(out, (offsets[1:] - offsets[:-1]).view(f, b).to(out.device))
        return out

    def _divide_means(self, out: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Sum-pooled ``out [B, sum of D]`` -> means for mean tables (``lengths [F, B]``)."""
        div = torch.where(self._mean[:, None], lengths.clamp(min=1), 1).float()  # [F, B]
        if self._equal_dims:
            f, d = len(self.feature_dims), self.feature_dims[0]
            out.view(-1, f, d).div_(div.t()[:, :, None])  # the kernel's fresh output, in place
            return out
        return out / torch.repeat_interleave(div.t(), self._dims, dim=1)

    def _host_kernel(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The TBE kernel itself on host weights: no cache state, so ``torch.compile`` traces it
        (the module's ``forward`` pops a TorchScript queue that dynamo cannot fake)."""
        t = self._tbe
        assert t is not None
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=t.weights_host,
            uvm_weights=t.weights_uvm,
            weights_placements=t.weights_placements,
            weights_offsets=t.weights_offsets,
            weights_tys=t.weights_tys,
            D_offsets=t.D_offsets,
            total_D=t.total_D,
            max_int2_D=t.max_int2_D,
            max_int4_D=t.max_int4_D,
            max_int8_D=t.max_int8_D,
            max_float16_D=t.max_float16_D,
            max_float32_D=t.max_float32_D,
            indices=indices,
            offsets=offsets,
            pooling_mode=int(t.pooling_mode),
            indice_weights=None,
            output_dtype=t.output_dtype,
            lxu_cache_weights=t.lxu_cache_weights,
            lxu_cache_locations=self._no_cache_locations,
            row_alignment=t.row_alignment,
            max_float8_D=t.max_float8_D,
            fp8_exponent_bits=t.fp8_exponent_bits,
            fp8_exponent_bias=t.fp8_exponent_bias,
        )

    @eager_under_compile
    def _cuda_module(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """fbgemm's module on CUDA (UVM caching keeps prefetch state between calls)."""
        assert self._tbe is not None
        return self._tbe(indices, offsets)

    def _torch_padded(self, features: list[torch.Tensor]) -> torch.Tensor:
        """Torch backend: per (dtype, dim) group one gather of packed rows, unpack, and a sum
        into bags by ``index_add_``: no unique, no host sync on the device tier."""
        b = features[0].shape[0]
        if len(self._groups) == 1:  # one row store: the whole batch is one gather
            g = self._groups[0]
            widths = tuple(m.shape[1] for m in features)
            flat = torch.cat([m.to(self.device).reshape(-1) for m in features])  # [n]
            mask = flat >= 0
            base = self._bag_index(b, widths, g.base)  # [n] first store row of each id's table
            packed = self._read(g, flat.clamp(min=0) + base, mask)
            dense = unpack_rows(packed, g.dtype, g.dim) * mask[:, None]  # [n, D]
            f = len(features)
            bags = self._bag_index(b, widths)
            sums = torch.zeros(f * b, g.dim, device=self.device).index_add_(0, bags, dense)
            out = sums.view(f, b, g.dim).transpose(0, 1).reshape(b, f * g.dim)
            if self._any_mean:
                counts = torch.zeros(f * b, device=self.device).index_add_(0, bags, mask.float())
                out = self._divide_means(out, counts.view(f, b).round().long())
            return out
        pooled: list[torch.Tensor] = [torch.empty(0)] * len(features)
        lengths: list[torch.Tensor] = [torch.empty(0)] * len(features)
        for g in self._groups:
            ids = [features[j].to(self.device) for j in g.features]
            rows = torch.cat([m.clamp(min=0).reshape(-1) + g.base[i] for i, m in enumerate(ids)])
            present = torch.cat([(m >= 0).reshape(-1) for m in ids]).float()  # [n]
            packed = self._read(g, rows, present > 0)
            dense = unpack_rows(packed, g.dtype, g.dim) * present[:, None]  # [n, D]
            bags = self._bag_index(b, tuple(m.shape[1] for m in ids))  # [n] bag of each id
            sums = torch.zeros(len(ids) * b, g.dim, device=self.device).index_add_(0, bags, dense)
            counts = torch.zeros(len(ids) * b, device=self.device).index_add_(0, bags, present)
            for i, j in enumerate(g.features):
                pooled[j] = sums[i * b : (i + 1) * b]
                lengths[j] = counts[i * b : (i + 1) * b]
        out = torch.cat(pooled, dim=1)
        if self._any_mean:
            out = self._divide_means(out, torch.stack(lengths).round().long())
        return out

    def _bag_index(
        self, b: int, widths: tuple[int, ...], per_feature: list[int] | None = None
    ) -> torch.Tensor:
        """For padded matrices ``[B, L_f]`` laid end to end: each id's bag ``[sum B*L_f]``, or
        with ``per_feature``, each id's feature's value (cached per shape)."""
        key = (b, widths, tuple(per_feature) if per_feature is not None else None)
        out = self._bags_cache.get(key)
        if out is None:
            if per_feature is None:
                parts = [
                    torch.arange(i * b, (i + 1) * b).repeat_interleave(w)
                    for i, w in enumerate(widths)
                ]
            else:
                parts = [torch.full((b * w,), v) for v, w in zip(per_feature, widths, strict=True)]
            out = torch.cat(parts).to(self.device)
            if len(self._bags_cache) > 64:
                self._bags_cache.clear()
            self._bags_cache[key] = out
        return out

    def _torch_lookup(self, indices: torch.Tensor, offsets: torch.Tensor, b: int) -> torch.Tensor:
        """Torch backend, jagged input. One row store: each id's bag from a search over the
        offsets, one gather, ``index_add_`` into bags (no host sync). Several: padded per
        feature, then :meth:`_torch_padded`."""
        if len(self._groups) == 1:
            g = self._groups[0]
            indices, offsets = indices.to(self.device), offsets.to(self.device)
            n = torch.arange(indices.numel(), device=self.device)
            bags = torch.searchsorted(offsets, n, right=True) - 1  # [n]
            assert g.base_t is not None
            base = g.base_t[bags // b]  # features in order
            packed = self._read(g, indices + base, torch.ones_like(indices, dtype=torch.bool))
            dense = unpack_rows(packed, g.dtype, g.dim)  # [n, D]
            f = len(self.feature_names)
            sums = torch.zeros(f * b, g.dim, device=self.device).index_add_(0, bags, dense)
            out = sums.view(f, b, g.dim).transpose(0, 1).reshape(b, f * g.dim)
            if self._any_mean:
                out = self._divide_means(out, (offsets[1:] - offsets[:-1]).view(f, b))
            return out
        lengths = (offsets[1:] - offsets[:-1]).view(-1, b).cpu()  # [F, B]
        bounds = offsets[::b].tolist()
        padded = []
        for j in range(len(self.feature_names)):
            seg = indices[bounds[j] : bounds[j + 1]].to(self.device)
            width = int(lengths[j].max()) if b else 0
            mask = torch.arange(width)[None, :] < lengths[j][:, None]  # [B, width]
            mat = torch.full((b, width), -1, dtype=torch.int64, device=self.device)
            mat[mask.to(self.device)] = seg
            padded.append(mat)
        return self._torch_padded(padded)
