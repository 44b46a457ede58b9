"""``IdMap``: raw int64 keys -> slots ``[0, capacity)`` with exact LRU / LFU / hybrid eviction.

The map is a C++ flat hash table (``csrc/idmap.cpp``, built on first use like the IVF scan
kernel); this module is its typed wrapper. Every call takes a batch, ``keys int64 [n]`` on CPU,
and releases the GIL while it works.

Time is counted in batches (``find`` with ``record=True`` and ``insert`` each advance a tick);
every occurrence of a key in a batch is one access. ``insert`` evicts only when the batch's new
keys outnumber the free slots, and then exactly the lowest-ranked slots among those the batch did
not touch (ties by slot index, so results are deterministic):

* ``lru``: oldest last access.
* ``lfu``: fewest accesses, then oldest last access.
* ``hybrid``: LFU whose counts halve every ``decay_period`` batches (``count >> epochs``, epoch =
  tick // decay_period), so a key that was hot long ago loses to one that is warm now.

New keys (first-occurrence order) take free slots lowest first, then victim slots in rank order.

Example::

    m = IdMap(capacity=2, policy="lru")
    m.insert(torch.tensor([10, 20]))[0]   # tensor([0, 1])
    m.find(torch.tensor([10, 30]))        # tensor([0, -1]); 10 is now the most recent
    slots, ev_keys, ev_slots = m.insert(torch.tensor([30]))
    # slots tensor([1]), ev_keys tensor([20]), ev_slots tensor([1])
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch

from common.cpp_extension import load_extension

POLICIES: tuple[str, ...] = ("lru", "lfu", "hybrid")
DEFAULT_DECAY_PERIOD = 16

_SRC = Path(__file__).parent / "csrc" / "idmap.cpp"


def _extension() -> ModuleType:
    """Builds (once per source version, cached on disk) and loads the C++ map."""
    return load_extension("recserve_idmap", _SRC, ("-O3",), ())


def build_kernel() -> None:
    """Compiles the C++ map now, if not cached (``recserve kernels``)."""
    _extension()


def as_keys(keys: torch.Tensor, field: str = "keys") -> torch.Tensor:
    """Checks ``keys`` is ``int64 [n]`` and returns it as a contiguous CPU tensor."""
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
        got = f"{keys.dtype} {tuple(keys.shape)}" if isinstance(keys, torch.Tensor) else type(keys)
        raise ValueError(f"{field} must be an int64 tensor [n], got {got}")
    return keys.detach().to("cpu").contiguous()


def sketch_add(counts: torch.Tensor, coef: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One sighting of every id of ``ids int64 [n]`` (CPU, contiguous) in the count-min sketch
    ``counts int32 [depth, width]`` (updated in place; hash coefficients ``coef int64
    [3, depth, 1]``, see :class:`~sharded_tables.id_transformer.AdmissionSketch`) -> each id's
    estimate ``int64 [n]``, read after every sighting is added."""
    return _extension().sketch_add(counts, coef, ids)


class DistinctResult(NamedTuple):
    """One :meth:`IdMap.find_distinct` batch (tensors ``int64``, CPU)."""

    keys: torch.Tensor
    """``[u]`` the distinct present keys, ascending."""
    slots: torch.Tensor
    """``[u]`` their slots, ``-1`` where absent."""
    positions: torch.Tensor
    """``[n]`` each key's position in ``keys`` (0 for padding)."""
    hits: int
    """Present occurrences whose key is held."""
    misses: int
    """Present occurrences whose key is not."""


class InsertResult(NamedTuple):
    """What one :meth:`IdMap.insert_detailed` batch did (all ``int64``, CPU)."""

    slots: torch.Tensor
    """``[n]`` slot of every key of the batch."""
    evicted_keys: torch.Tensor
    """``[m]`` keys evicted to make room, best victim first."""
    evicted_slots: torch.Tensor
    """``[m]`` their slots, now reused by new keys of this batch."""
    new_keys: torch.Tensor
    """``[u]`` keys absent before the batch, in first-occurrence order."""
    new_slots: torch.Tensor
    """``[u]`` the slots they got."""


class IdMap:
    """Raw 64-bit keys -> slots ``[0, capacity)``; see the module docstring for the policies.

    Args:
        capacity: number of slots (``0`` is allowed: nothing is ever found or inserted).
        policy: ``"lru"``, ``"lfu"`` or ``"hybrid"``.
        decay_period: batches between count halvings (``hybrid`` only).
    """

    def __init__(
        self, capacity: int, policy: str = "lru", decay_period: int = DEFAULT_DECAY_PERIOD
    ) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if decay_period < 1:
            raise ValueError(f"decay_period must be >= 1, got {decay_period}")
        self.policy = policy
        self.decay_period = decay_period
        self._impl: Any = _extension().IdMap(capacity, POLICIES.index(policy), decay_period)

    @property
    def capacity(self) -> int:
        return int(self._impl.capacity())

    @property
    def size(self) -> int:
        """Keys held now."""
        return int(self._impl.size())

    def __len__(self) -> int:
        return self.size

    def find(self, keys: torch.Tensor, record: bool = True) -> torch.Tensor:
        """``keys int64 [n]`` -> ``slots int64 [n]``, ``-1`` where absent.

        With ``record`` (the default) this is one batch: hits count as accesses for the policy.
        ``record=False`` is a pure lookup that leaves the policy state untouched.
        """
        return self._impl.find(as_keys(keys), record)

    def find_distinct(self, keys: torch.Tensor, record: bool = True) -> DistinctResult:
        """``keys int64 [n]`` (any order, repeats, ``-1`` = padding) -> the distinct present
        keys, their slots and each key's position among them (:class:`DistinctResult`), in one
        pass. With ``record``, one batch of :meth:`find`: every present occurrence is an access.
        """
        return DistinctResult(*self._impl.find_distinct(as_keys(keys), record))

    def insert(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``keys int64 [n]`` -> ``(slots [n], evicted_keys [m], evicted_slots [m])``.

        Present keys keep their slot (one access each occurrence); absent ones get a free slot
        or a victim's. Repeats of a key share one slot. Raises ``ValueError`` (and changes
        nothing) when the batch holds more distinct keys than ``capacity``.
        """
        r = self.insert_detailed(keys)
        return r.slots, r.evicted_keys, r.evicted_slots

    def insert_detailed(self, keys: torch.Tensor) -> InsertResult:
        """:meth:`insert` that also says which keys were new and where they went."""
        return InsertResult(*self._impl.insert(as_keys(keys)))

    def remove(self, keys: torch.Tensor) -> torch.Tensor:
        """Drops ``keys int64 [n]``; returns the slots they held ``[n]`` (``-1``: absent)."""
        return self._impl.remove(as_keys(keys))

    def keys_and_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys [size], slots [size])`` of every held key, in slot order."""
        keys, slots, _, _, _ = self._impl.state()
        return keys, slots

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything the policy needs, as tensors (``torch.save``-able).

        ``keys, slots, counts, last_access`` are ``int64 [size]`` in slot order (hybrid counts
        already decayed to now); ``tick`` and ``capacity`` are 0-d ``int64``.
        """
        keys, slots, counts, last, tick = self._impl.state()
        return {
            "keys": keys,
            "slots": slots,
            "counts": counts,
            "last_access": last,
            "tick": torch.tensor(tick, dtype=torch.int64),
            "capacity": torch.tensor(self.capacity, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replaces this map's contents with ``state`` (from :meth:`state_dict`).

        Raises ``ValueError`` naming the bad field; a rejected state leaves the map empty.
        """
        missing = {"keys", "slots", "counts", "last_access", "tick"} - set(state)
        if missing:
            raise ValueError(f"state is missing {sorted(missing)}")
        if "capacity" in state and int(state["capacity"]) != self.capacity:
            raise ValueError(
                f"capacity: state has {int(state['capacity'])}, this map has {self.capacity}"
            )
        self._impl.load(
            as_keys(state["keys"], "keys"),
            as_keys(state["slots"], "slots"),
            as_keys(state["counts"], "counts"),
            as_keys(state["last_access"], "last_access"),
            int(state["tick"]),
        )

    @classmethod
    def from_state_dict(
        cls,
        state: dict[str, torch.Tensor],
        policy: str = "lru",
        decay_period: int = DEFAULT_DECAY_PERIOD,
    ) -> IdMap:
        """A new map of ``state["capacity"]`` slots holding ``state``."""
        if "capacity" not in state:
            raise ValueError("state is missing ['capacity']")
        m = cls(int(state["capacity"]), policy, decay_period)
        m.load_state_dict(state)
        return m
