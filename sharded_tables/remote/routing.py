"""Where a remote table's rows live: which embedding server holds which ids.

* ``partition="range"``: server ``s`` holds the GLOBAL rows ``[bounds[s], bounds[s + 1])``.
* ``partition="keyed"``: server ``splitmix64(id) % S`` holds the raw 64-bit key ``id``.

Example::

    t = RemoteTable("item", DType.INT8, 16, ("a:1", "b:2"), "range", bounds=(0, 5000, 10000))
    server_of(t, np.array([7, 9000]))  # array([0, 1])
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import numpy as np
import torch

from sharded_tables.remote.server_files import Partition
from sharded_tables.specs import DType, row_bytes

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class RemoteTable:
    """Where one table's rows live.

    ``bounds`` (range only): ``len(servers) + 1`` ascending global row ids; server ``s`` holds
    ``[bounds[s], bounds[s + 1])``.
    """

    name: str
    dtype: DType
    dim: int
    servers: tuple[str, ...]
    partition: Partition = "range"
    bounds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType(self.dtype))
        object.__setattr__(self, "servers", tuple(self.servers))
        object.__setattr__(self, "bounds", tuple(int(b) for b in self.bounds))
        row_bytes(self.dim, self.dtype)
        if not self.servers:
            raise ValueError(f"table {self.name!r}: servers must not be empty")
        if self.partition == "range":
            b = self.bounds
            if len(b) != len(self.servers) + 1 or any(x > y for x, y in pairwise(b)):
                raise ValueError(
                    f"table {self.name!r}: bounds must be {len(self.servers) + 1} ascending row "
                    f"ids (one more than servers), got {list(b)}"
                )
        elif self.partition != "keyed":
            raise ValueError(f"table {self.name!r}: partition must be 'range' or 'keyed'")

    @cached_property  # read on every lookup
    def row_bytes(self) -> int:
        return row_bytes(self.dim, self.dtype)


def splitmix64(ids: np.ndarray | torch.Tensor) -> np.ndarray:
    """The splitmix64 finaliser of ``ids int64 [n]`` -> ``uint64 [n]`` (stable across runs)."""
    ids = ids.numpy() if isinstance(ids, torch.Tensor) else ids
    z = ids.astype(np.int64).view(np.uint64) + _GOLDEN  # wraps mod 2^64
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def server_of(table: RemoteTable, ids: np.ndarray) -> np.ndarray:
    """Server position (into ``table.servers``) of each id: ``int64 [n]`` for ``ids int64 [n]``.

    Raises ``ValueError`` naming the table and id for a ranged id that no server holds.
    """
    if table.partition == "keyed":
        return (splitmix64(ids) % np.uint64(len(table.servers))).astype(np.int64)
    lo, hi = table.bounds[0], table.bounds[-1]
    outside = (ids < lo) | (ids >= hi)
    if outside.any():
        raise ValueError(
            f"table {table.name!r}: id {ids[outside][0]} is outside the table's rows [{lo}, {hi})"
        )
    return np.searchsorted(np.asarray(table.bounds[1:]), ids, side="right")


def route(table: RemoteTable, ids: torch.Tensor) -> torch.Tensor:
    """:func:`server_of` for a tensor: ``ids int64 [n]`` -> server positions ``int64 [n]``."""
    return torch.from_numpy(server_of(table, ids.cpu().numpy()).astype(np.int64))
