"""``TransformedTable``: a hashed embedding table whose evicted rows live in a ``RowStore``.

The table keeps float32 rows ``[capacity, D]`` for the ids its :class:`IdTransformer` holds.
When the transformer evicts an id, its row is packed and ``put`` into the store *before* the row
is reused; when an id is admitted, its row is read back from the store (found: restored; never
stored: initialised). So no learned row is lost, and unseen ids need no rebuild.

Example::

    store = MemoryRowStore({"user": row_bytes(16, DType.FP32)})
    table = TransformedTable("user", capacity=1000, dim=16, store=store)
    emb = table.lookup(torch.tensor([123456789012, 42]))   # float32 [2, 16]
"""

from __future__ import annotations

import torch

from sharded_tables.id_transformer import IdTransformer
from sharded_tables.idmap import DEFAULT_DECAY_PERIOD
from sharded_tables.quantize import pack_rows, unpack_rows
from sharded_tables.specs import DType
from sharded_tables.store import RowStore

_M31 = 0x7FFFFFFF


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An avalanche hash on ``int64`` values in ``[0, 2^31)`` (products stay below 2^63)."""
    for _ in range(2):
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & _M31
    return x ^ (x >> 16)


def hashed_uniform(ids: torch.Tensor, dim: int, scale: float, seed: int = 0) -> torch.Tensor:
    """``ids int64 [a]`` -> ``float32 [a, dim]`` uniform in ``[-scale, scale)``, a pure function
    of ``(seed, id, column)``: an id starts from the same row whatever batch first brings it."""
    h = _mix31((ids & _M31) ^ (seed & _M31))
    h = _mix31(h ^ ((ids >> 31) & _M31))
    h = _mix31(h ^ ((ids >> 62) & 3))  # [a]
    cols = _mix31(torch.arange(1, dim + 1, dtype=torch.int64))  # [dim]
    u = _mix31(h[:, None] ^ cols[None, :]).float() / float(1 << 31)  # [a, dim] in [0, 1)
    return (2 * u - 1) * scale


class TransformedTable:
    """Float32 rows of a hashed table, backed by a row store.

    Args:
        name: table name (the store's key).
        capacity: local rows.
        dim: row width D.
        store: where evicted rows go and admitted rows come from.
        dtype: how rows are packed in the store (``fp32`` round-trips bit for bit).
        policy, admit_after, decay_period: the :class:`IdTransformer`'s.
        init_scale: rows never stored start uniform in ``[-init_scale, init_scale)`` (0: zeros).
        seed: seed of that initialisation.
        device: where the rows live.

    Not thread-safe: serialise ``lookup`` calls (as one model replica does).
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        dim: int,
        store: RowStore,
        *,
        dtype: DType = DType.FP32,
        policy: str = "lru",
        admit_after: int = 1,
        decay_period: int = DEFAULT_DECAY_PERIOD,
        init_scale: float = 0.0,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        if dim < 1:
            raise ValueError(f"table {name!r}: dim must be >= 1, got {dim}")
        self.name = name
        self.dim = dim
        self.store = store
        self.dtype = DType(dtype)
        self.init_scale = init_scale
        self.seed = seed
        self.transformer = IdTransformer(capacity, policy, admit_after, decay_period, seed=seed)
        self.weight = torch.zeros(capacity, dim, dtype=torch.float32, device=device)

    def lookup(self, raw_ids: torch.Tensor) -> torch.Tensor:
        """``raw_ids int64 [n]`` -> ``float32 [n, D]`` (zero rows for ids not admitted yet).

        If the store fails, the evicted ids are already unmapped and their rows may be lost;
        callers that cannot afford that need a store that does not fail (or retries).
        """
        r = self.transformer.transform(raw_ids)
        dev = self.weight.device
        if len(r.evicted_ids):  # save before the admitted ids below overwrite these rows
            old = self.weight[r.evicted_rows.to(dev)]
            self.store.put(self.name, r.evicted_ids, pack_rows(old, self.dtype).cpu())
        if len(r.admitted_ids):
            packed, found = self.store.get(self.name, r.admitted_ids)  # [a, rb], [a]
            rows = unpack_rows(packed, self.dtype, self.dim)  # [a, D]
            if self.init_scale > 0:
                fresh = hashed_uniform(r.admitted_ids, self.dim, self.init_scale, self.seed)
            else:
                fresh = torch.zeros_like(rows)
            rows = torch.where(found[:, None], rows, fresh)
            self.weight[r.admitted_rows.to(dev)] = rows.to(dev)
        out = torch.zeros(len(r.rows), self.dim, dtype=torch.float32, device=dev)
        hit = r.rows >= 0
        out[hit.to(dev)] = self.weight[r.rows[hit].to(dev)]
        return out

    def flush(self) -> None:
        """Writes every resident row to the store (e.g. before a checkpoint or shutdown)."""
        ids, rows = self.transformer.map.keys_and_slots()
        if len(ids):
            packed = pack_rows(self.weight[rows.to(self.weight.device)], self.dtype)
            self.store.put(self.name, ids, packed.cpu())
