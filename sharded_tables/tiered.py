"""TieredEmbeddingCollection: the towers' table call over tiered, quantized tables.

Same call shape as :class:`~sharded_tables.collection.EmbeddingCollection`:
``{feature: ids [B, L] int64, -1 = none} -> {feature: pooled [B, D] float32}``, so the model
switches from plain tables to tiered ones by configuration. A :class:`PlacementPlan` says where
each table lives; this module executes it:

* device / host tables: packed rows in :class:`LocalTables` (one fbgemm TBE call per tier);
* remote tables (:class:`~sharded_tables.remote_tier.RemoteTier`): a small table the plan caches
  whole is copied from the embedding servers once and then read like a host table; for the
  others, the ids of the whole batch are de-duplicated per table, looked up in the table's
  hot-row cache, and the misses fetched from the embedding servers in one request per server
  (:class:`~sharded_tables.remote.client.RemoteTables`).

State (``state_dict``) holds the plan and the packed rows of local tables; remote rows live in
the embedding servers' folders (:meth:`export_remote`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from common.compile_boundary import eager_under_compile
from sharded_tables.cache import HotRowCache
from sharded_tables.collection import check_id_features
from sharded_tables.interface import RemoteStats, RowUpdateRefusedError
from sharded_tables.keyed_bag import KeyedBag
from sharded_tables.planner import PlacementPlan, TablePlacement
from sharded_tables.quantize import pack_rows, unpack_rows
from sharded_tables.remote_tier import RemoteFetcher, RemoteTier, pool_rows, present_ids
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.store import RowStore
from sharded_tables.tbe import LocalTable, LocalTables


class TieredEmbeddingCollection(nn.Module):
    """Pooled lookups over tables placed by a plan: ``{feature: [B, L]} -> {feature: [B, D]}``
    (a :class:`~sharded_tables.interface.TableCollection`)."""

    def __init__(
        self,
        specs: Sequence[TableSpec],
        plan: PlacementPlan,
        device: torch.device | str = "cpu",
        remote: RemoteFetcher | None = None,
        timeout: float | None = None,
        cache_policy: str = "hybrid",
        cache_admit_after: int = 2,
    ):
        """``timeout``: seconds each remote fetch may take; None: the fetcher's own deadline
        (a router's ``embedding_timeout_ms``: a default here would override it).
        ``cache_policy`` / ``cache_admit_after``: the hot-row caches' eviction policy and
        admission threshold (:class:`HotRowCache`); decayed LFU with admission on a second
        sighting keeps a skewed stream's head cached while its long tail passes through."""
        super().__init__()
        self.cache_policy, self.cache_admit_after = cache_policy, cache_admit_after
        self.specs = {s.name: s for s in specs}
        self.plan = plan
        self.device = torch.device(device)
        self.remote = remote
        self.timeout = timeout
        missing = sorted(set(self.specs) - {p.table for p in plan.tables})
        if missing:
            raise ValueError(f"the plan does not place tables {missing}")
        self.table_of: dict[str, str] = {}
        for s in specs:
            for f in s.feature_names():
                if f in self.table_of:
                    raise ValueError(f"feature {f!r} is assigned to two tables")
                self.table_of[f] = s.name
        # Not registered as submodules: rows stay where the plan put them when the model moves
        # (``model.to("cuda")`` must not copy a host tier into HBM); they save via extra state.
        self.tiers: dict[str, LocalTables] = {}
        self._module_of: dict[str, LocalTables] = {}
        for tier in self._local_tiers():
            for backend in ("fbgemm", "torch"):
                tables = [
                    LocalTable(
                        s.name,
                        s.rows,
                        s.dim,
                        p.dtype,
                        s.feature_names(),
                        s.pooling,
                        cache_rows=self._device_cache_rows(p),
                    )
                    for s, p in self._placed()
                    if self._local_tier_of(p.tier) == tier
                    and not s.hashed
                    and self._backend(p.dtype) == backend
                ]
                if tables:
                    module = LocalTables(
                        tables,
                        tier=tier,
                        device=self.device,
                        backend="torch" if backend == "torch" else None,
                        cache_policy=cache_policy,
                        cache_admit_after=cache_admit_after,
                    )
                    self.tiers[tier if backend == "fbgemm" else f"{tier}/{backend}"] = module
                    self._module_of.update({t.name: module for t in tables})
        kernel = {s.name: "torch" if self._backend(p.dtype) == "torch" else None
                  for s, p in self._placed()}  # fmt: skip
        self.remote_tier = RemoteTier(
            self.specs, plan, self.device, kernel, cache_policy, cache_admit_after
        )
        # copied whole: pooled with the local tiers, once the copy is made (see RemoteTier)
        self.tiers.update(self.remote_tier.whole_modules)
        for module in self.remote_tier.whole_modules.values():
            self._module_of.update({t.name: module for t in module.tables})
        self._whole_features = frozenset(
            f for f, t in self.table_of.items() if t in self.remote_tier.whole
        )
        self.caches: dict[str, HotRowCache] = self.remote_tier.caches
        self._hot_remote = frozenset(self.caches)  # remote tables read through their caches
        # Hashed tables in a local tier: every learned id's row, packed, looked up by key
        self.keyed: dict[str, KeyedBag] = {
            s.name: KeyedBag(s.dim, p.dtype)
            for s, p in self._placed()
            if s.hashed and p.tier is not Tier.REMOTE
        }
        self.stats = RemoteStats()

    # ---- placement ----------------------------------------------------------------------------
    def _placed(self) -> list[tuple[TableSpec, Any]]:
        return [(self.specs[name], self.plan.placement(name)) for name in self.specs]

    def _backend(self, dtype: DType) -> str:
        # fbgemm's CPU kernel for FP8 rows is a generic scalar loop (far slower than its INT8
        # one: bench/tables.py); unpacking the unique rows with torch is faster there.
        return "torch" if dtype is DType.FP8 and self.device.type == "cpu" else "fbgemm"

    def _local_tiers(self) -> list[str]:
        # Without a GPU, "device" is the fastest in-process copy: host DRAM, one TBE call.
        return ["device", "host"] if self.device.type == "cuda" else ["host"]

    def _local_tier_of(self, tier: Tier) -> str | None:
        if tier is Tier.REMOTE:
            return None
        return tier.value if self.device.type == "cuda" else "host"

    def _device_cache_rows(self, p: TablePlacement) -> int:
        """A host table's rows cached in HBM: the plan's, on a GPU (on a CPU the host tier is
        already the fastest copy). Only the torch backend builds the cache (fbgemm's CUDA
        kernel caches host rows itself, UVM)."""
        return p.cache_rows if self.device.type == "cuda" and p.tier is Tier.HOST else 0

    def _is_remote(self, table: str) -> bool:
        """Whether ``table``'s lookups go through the hot-row path (remote, not copied whole)."""
        return table in self._hot_remote

    # ---- weights ----------------------------------------------------------------------------
    def load_float(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Quantizes float tables ``{name: [rows, D]}`` per the plan into the local tiers.

        Returns the packed rows of remote tables (``{name: uint8 [rows, row_bytes]}``), which
        belong in the embedding servers' folders (see :meth:`export_remote`).
        """
        remote: dict[str, torch.Tensor] = {}
        for s, p in self._placed():
            if s.hashed:
                continue  # rows of raw ids arrive through the id transformer
            if s.name not in weights:
                raise ValueError(f"no weights for table {s.name!r}")
            w = weights[s.name]
            if tuple(w.shape) != (s.rows, s.dim):
                raise ValueError(
                    f"table {s.name!r}: expected weights [{s.rows}, {s.dim}], got {list(w.shape)}"
                )
            packed = pack_rows(w.detach().float().cpu(), p.dtype)
            if p.tier is Tier.REMOTE:
                remote[s.name] = packed
            else:
                self._local_module(s.name).set_packed(s.name, packed)
        return remote

    def _local_module(self, table: str) -> LocalTables:
        return self._module_of[table]

    def local_float(self, name: str) -> torch.Tensor:
        """Dequantized rows ``[rows, D]`` of a local table (what lookups read)."""
        p = self.plan.placement(name)
        s = self.specs[name]
        return unpack_rows(self._local_module(name).packed(name), p.dtype, s.dim)

    def float_weights(self) -> dict[str, torch.Tensor]:
        """Refused: the float rows were quantized (:meth:`local_float` dequantizes one local
        table) or live on embedding servers."""
        raise ValueError("the model's tables are already tiered (quantized rows, by a plan)")

    def row_writer(
        self, table: str, rows: torch.Tensor, values: torch.Tensor
    ) -> Callable[[], None]:
        """Re-packs ``values [n, D]`` in the table's dtype; the write puts them into ``rows [n]``
        where the kernel reads them. A hashed table's ``rows`` are raw keys: inserted or
        replaced (:meth:`_keyed_writer`). Ranged remote tables are refused."""
        spec, placement = self.specs[table], self.plan.placement(table)
        if spec.hashed:
            return self._keyed_writer(table, rows, values)
        if placement.tier is Tier.REMOTE:
            raise RowUpdateRefusedError(
                f"table {table!r} lives on the remote tier (embedding servers, with hot-row "
                "caches here): its rows are not updated in place; publish a new version"
            )
        try:
            packed = pack_rows(values, placement.dtype)
        except ValueError as e:
            raise ValueError(f"{e} (table {table!r} is {placement.dtype.value})") from None
        module = self._local_module(table)

        def write() -> None:
            try:
                view = module.rows_view(table)
            except NotImplementedError:  # fbgemm's CUDA storage: rewrite the whole table
                whole = module.packed(table)
                whole[rows] = packed
                module.set_packed(table, whole)
                return
            view[rows.to(view.device)] = packed.to(view.device)
            module.rows_written(table, rows)  # a device cache forgets its old copies

        return write

    def _keyed_writer(
        self, table: str, keys: torch.Tensor, values: torch.Tensor
    ) -> Callable[[], None]:
        """A hashed table's live write: keys ``[n]`` take ``values [n, D]`` (new keys are
        inserted). In the process: a new packed copy; on the embedding servers: a durable put,
        then this process's hot-row cache forgets the keys (other processes' caches keep theirs
        until evicted)."""
        dtype = self.plan.placement(table).dtype
        try:
            packed = pack_rows(values, dtype)
        except ValueError as e:
            raise ValueError(f"{e} (table {table!r} is {dtype.value})") from None
        if table in self.keyed:
            bag = self.keyed[table]
            return lambda: bag.upsert_packed(keys, packed)
        remote = self.remote
        if not isinstance(remote, RowStore):
            raise RowUpdateRefusedError(
                f"table {table!r} lives on embedding servers this process cannot write to"
            )
        cache = self.caches.get(table)

        def write() -> None:
            remote.put(table, keys, packed)
            if cache is not None:
                cache.invalidate(keys)

        return write

    def get_extra_state(self) -> dict[str, Any]:
        packed = {}
        for s, p in self._placed():
            if p.tier is not Tier.REMOTE and not s.hashed:
                packed[s.name] = self._local_module(s.name).packed(s.name)
        keyed = {name: bag.get_extra_state() for name, bag in self.keyed.items()}
        return {"plan": self.plan.to_json(), "packed": packed, "keyed": keyed}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        saved = PlacementPlan.from_json(state["plan"])
        if saved.to_dict() != self.plan.to_dict():
            raise ValueError("saved table plan differs from this collection's plan")
        for name, packed in state["packed"].items():
            self._local_module(name).set_packed(name, packed)
        for name, saved_rows in state.get("keyed", {}).items():
            self.keyed[name].set_extra_state(saved_rows)

    # ---- lookups ----------------------------------------------------------------------------
    def table_rows(self) -> dict[str, int | None]:
        """Rows of each table; None for a hashed table (it takes any raw id)."""
        return {n: (None if s.hashed else s.rows) for n, s in self.specs.items()}

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        """``{table: (rows, D)}`` (a hashed table's rows: its local working rows)."""
        return {n: (s.rows, s.dim) for n, s in self.specs.items()}

    def validate(self, features: Mapping[str, torch.Tensor]) -> None:
        """Edge check (:func:`check_id_features`; hashed tables take any raw id)."""
        check_id_features(features, self.table_of, self.table_rows())

    def forward(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pools every feature. Trusts its inputs (:meth:`validate` runs at the edge)."""
        if not self._whole_features.isdisjoint(features):
            self.remote_tier.copy_whole(self.remote, self.timeout)
        first = next(iter(features.values()))
        b, out_device = first.shape[0], first.device  # pooled rows go where the ids came from
        out: dict[str, torch.Tensor] = {}
        for module in self.tiers.values():
            wanted = [f for f in module.feature_names if f in features]
            if not wanted:
                continue
            empty = torch.empty(b, 0, dtype=torch.int64, device=module.device)
            padded = [features.get(f, empty).to(module.device) for f in module.feature_names]
            pooled = module.forward_padded(padded).to(out_device).split(module.feature_dims, dim=1)
            out.update({f: pooled[i] for i, f in enumerate(module.feature_names) if f in features})
        by_table: dict[str, list[str]] = {}
        for f in features:
            if self._is_remote(self.table_of[f]):
                by_table.setdefault(self.table_of[f], []).append(f)
        if by_table:
            out.update(
                self.remote_tier.lookup(by_table, features, self.remote, self.timeout, self.stats)
            )
        hashed = [f for f in features if self.table_of[f] in self.keyed]
        if hashed:
            out.update(self._hashed_lookup({f: features[f] for f in hashed}))
        return {f: out[f].to(out_device) for f in features}

    def forward_jagged(
        self, keys: Sequence[str], values: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """KeyedJaggedTensor-style input -> ``[B, sum of D]`` (features in ``keys`` order).

        ``values``: the ids of all features end to end; ``offsets [len(keys) * B + 1]``: where
        each (feature, sample) bag starts, feature-major (``kjt.values()``, ``kjt.offsets()``
        of a TorchRec ``KeyedJaggedTensor``). When the keys are exactly one local tier's
        features this is a single kernel call on the caller's tensors.
        """
        keys = list(keys)
        if not self._whole_features.isdisjoint(keys):
            self.remote_tier.copy_whole(self.remote, self.timeout)
        for module in self.tiers.values():
            if keys == module.feature_names:
                return module(values.to(module.device), offsets.to(module.device)).to(values.device)
        b = (offsets.numel() - 1) // len(keys)
        lengths = (offsets[1:] - offsets[:-1]).view(len(keys), b)
        padded = {}
        for j, name in enumerate(keys):
            seg = values[offsets[j * b] : offsets[(j + 1) * b]]
            width = int(lengths[j].max()) if b else 0
            mat = torch.full((b, width), -1, dtype=torch.int64, device=values.device)
            mask = torch.arange(width, device=values.device)[None, :] < lengths[j][:, None]
            mat[mask] = seg
            padded[name] = mat
        out = self(padded)
        return torch.cat([out[k] for k in keys], dim=1)

    @eager_under_compile
    def _hashed_lookup(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Local hashed tables: unique raw ids -> their rows (zeros for ids never learned)."""
        out = {}
        for table, feats in self._group(features).items():
            u = self._unique_ids(table, [features[f] for f in feats])
            dense = self.keyed[table].lookup(u)[0].to(self.device)  # [U, D]
            spec, u = self.specs[table], u.to(self.device)
            for f in feats:
                ids = features[f].to(self.device)
                out[f] = pool_rows(spec, ids, u, dense, mean=spec.pooling == "mean")
        return out

    def _group(self, features: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
        by_table: dict[str, list[str]] = {}
        for f in features:
            by_table.setdefault(self.table_of[f], []).append(f)
        return by_table

    def _unique_ids(self, table: str, id_mats: list[torch.Tensor]) -> torch.Tensor:
        """The sorted distinct ids of a whole batch for one table ``[U]`` (CPU)."""
        spec = self.specs[table]
        ids = torch.cat([m[present_ids(spec, m)] for m in id_mats]).cpu()
        u = torch.unique(ids)
        self.stats.ids += ids.numel()
        self.stats.unique += u.numel()
        return u

    def keyed_rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{table: (keys, float rows)}`` of the local hashed tables (dequantized)."""
        return {name: (bag.keys, bag.rows) for name, bag in self.keyed.items()}

    def load_keyed(
        self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Takes every hashed table's ``(keys, float rows)``: local ones are packed here; ->
        ``{table: (keys, packed rows)}`` of those on embedding servers (their folders')."""
        remote = {}
        for name, (keys, values) in rows.items():
            spec = self.specs.get(name)
            if spec is None or not spec.hashed:
                raise ValueError(f"{name!r} is not a hashed table of this collection")
            if name in self.keyed:
                self.keyed[name].load(keys, values)
            else:
                dtype = self.plan.placement(name).dtype
                remote[name] = (keys, pack_rows(values.detach().float().cpu(), dtype))
        return remote

    def cache_stats(self) -> dict[str, dict[str, float]]:
        """``{table: counters}`` of each remote table's hot-row cache, and ``{row store:
        counters}`` (``"host/int8/64"``) of each of the host tier's device caches."""
        out = {t: c.stats() for t, c in self.caches.items()}
        for module in self.tiers.values():
            out.update(module.cache_stats())
        return out

    def between_batches(self) -> None:
        """The host tier's device caches admit what the last batches missed (a host read
        each, outside the forward: a graph of the forward only reads the caches)."""
        for module in self.tiers.values():
            module.admit_cached()

    def remote_stats(self) -> RemoteStats:
        """The counters of lookups that left the local tiers (the live object)."""
        return self.stats
