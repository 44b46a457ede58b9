"""``IdTransformer``: an unbounded raw 64-bit id space -> rows of a local table of ``capacity``.

As in dynamic-embedding designs (TorchRec's contrib ``IDTransformer``), the local table holds only
the ids in use; an :class:`~sharded_tables.idmap.IdMap` assigns their rows and, when the table is
full, evicts by its policy. The caller (:class:`sharded_tables.hashed_training.HashedTrainingTables`)
saves evicted rows and restores or initialises admitted ones.

Admission: with ``admit_after = k > 1`` an id gets a row only once it has been seen ``k`` times
(every occurrence counts); until then its row is ``-1`` and the caller uses a zero row. Sightings
are counted in a count-min sketch (:class:`AdmissionSketch`) of ``depth x width`` int32 counters,
a fixed memory bound whatever the id space; it may overcount (admit early), never undercount.

Example::

    t = IdTransformer(capacity=2, admit_after=2)
    t.transform(torch.tensor([7, 9])).rows        # tensor([-1, -1]): seen once
    r = t.transform(torch.tensor([7, 7, 9]))      # rows tensor([0, 0, 1]); admitted_ids [7, 9]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sharded_tables.idmap import DEFAULT_DECAY_PERIOD, IdMap, as_keys, sketch_add

_PRIME = (1 << 31) - 1  # hash arithmetic stays below 2^63: 31-bit factors times 32-bit halves


class AdmissionSketch:
    """Count-min sketch of id sightings: ``depth`` rows of ``width`` int32 counters.

    Estimates exceed the true count by at most ``e N / width`` with probability
    ``1 - e^-depth``, ``N`` the sightings since the last halving. Every ``10 width`` sightings all
    counters halve (TinyLFU's aging), so ``N`` stays bounded and old sightings fade.

    Row ``r`` hashes an id with its 32-bit halves as ``((lo a_r) mod p + (hi b_r) mod p + c_r)
    mod p mod width``, ``p = 2^31 - 1``. The update runs in C++ (``csrc/idmap.cpp``'s
    ``sketch_add``): a cache miss of a served batch is a few ids, for which a dozen NumPy calls
    cost many times what one C++ call does.
    """

    def __init__(self, width: int, depth: int = 4, seed: int = 0) -> None:
        if width < 1 or depth < 1:
            raise ValueError(f"sketch width and depth must be >= 1, got {width}, {depth}")
        g = torch.Generator().manual_seed(seed)
        self.coef = torch.randint(1, _PRIME, (3, depth, 1), generator=g)  # a, b, c per row
        self.counts = torch.zeros(depth, width, dtype=torch.int32)
        self.reset_after = 10 * width
        self.sightings = 0

    def add(self, ids: torch.Tensor) -> torch.Tensor:
        """Counts one sighting per element of ``ids int64 [n]``; returns estimates ``[n]``
        (sightings so far, these included: every sighting is added before any is read)."""
        estimate = sketch_add(self.counts, self.coef, as_keys(ids, "ids"))
        self.sightings += len(ids)
        if self.sightings >= self.reset_after:
            self.counts >>= 1
            self.sightings //= 2
        return estimate


class TransformResult(NamedTuple):
    """One :meth:`IdTransformer.transform` batch (``int64``, CPU)."""

    rows: torch.Tensor
    """``[n]`` local row of every raw id, ``-1`` where not admitted (use a zero row)."""
    evicted_ids: torch.Tensor
    """``[m]`` ids that lost their row in this batch; their old contents must be saved first."""
    evicted_rows: torch.Tensor
    """``[m]`` the rows they held (reused by ``admitted_ids``)."""
    admitted_ids: torch.Tensor
    """``[a]`` ids that got a row in this batch (distinct); restore or initialise these rows."""
    admitted_rows: torch.Tensor
    """``[a]`` their rows."""


class IdTransformer:
    """Raw ids -> rows ``[0, capacity)`` with admission and policy eviction.

    Args:
        capacity: rows of the local table.
        policy: ``"lru"``, ``"lfu"`` or ``"hybrid"`` (see :mod:`sharded_tables.idmap`).
        admit_after: sightings before an id gets a row (``1``: at once).
        decay_period: batches between count halvings (``hybrid`` only).
        sketch_width: counters per sketch row (default ``max(1024, 2 capacity)``, rounded up to
            a power of two).
        seed: seed of the sketch's hash functions.

    A batch with more distinct ids than ``capacity`` admits only as many new ids as fit (the
    smallest ids first); the others get ``-1`` this time. One caller at a time: a transform
    peeks, counts and inserts as separate steps.
    """

    def __init__(
        self,
        capacity: int,
        policy: str = "lru",
        admit_after: int = 1,
        decay_period: int = DEFAULT_DECAY_PERIOD,
        sketch_width: int | None = None,
        seed: int = 0,
    ) -> None:
        if admit_after < 1:
            raise ValueError(f"admit_after must be >= 1, got {admit_after}")
        self.map = IdMap(capacity, policy, decay_period)
        self.admit_after = admit_after
        self.sketch: AdmissionSketch | None = None
        if admit_after > 1:
            width = sketch_width or 1 << (max(1024, 2 * capacity) - 1).bit_length()
            self.sketch = AdmissionSketch(width, seed=seed)

    @property
    def capacity(self) -> int:
        return self.map.capacity

    def transform(self, raw_ids: torch.Tensor) -> TransformResult:
        """``raw_ids int64 [n]`` -> :class:`TransformResult`; one policy batch."""
        ids = as_keys(raw_ids, "raw_ids")
        if self.admit_after == 1 and len(ids) <= self.capacity:
            r = self.map.insert_detailed(ids)  # fits by construction: no peek needed
            return TransformResult(
                r.slots, r.evicted_keys, r.evicted_slots, r.new_keys, r.new_slots
            )
        present = self.map.find(ids, record=False) >= 0  # a peek: the insert below is the batch
        want = present.clone()
        miss_ids = ids[~present]
        if len(miss_ids):
            ok = torch.ones(len(miss_ids), dtype=torch.bool)
            if self.sketch is not None:
                ok = self.sketch.add(miss_ids) >= self.admit_after
            new = torch.unique(miss_ids[ok])  # sorted
            room = self.capacity - len(torch.unique(ids[present]))
            if len(new) > room:
                ok &= torch.isin(miss_ids, new[:room])
            want[~present] = ok
        r = self.map.insert_detailed(ids[want])
        rows = torch.full((len(ids),), -1, dtype=torch.int64)
        rows[want] = r.slots
        return TransformResult(rows, r.evicted_keys, r.evicted_slots, r.new_keys, r.new_slots)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The map's state (:meth:`IdMap.state_dict`) plus the sketch's counters, if any."""
        state = self.map.state_dict()
        if self.sketch is not None:
            state["sketch_counts"] = self.sketch.counts.clone()
            state["sketch_sightings"] = torch.tensor(self.sketch.sightings)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.map.load_state_dict(state)
        if self.sketch is not None and "sketch_counts" in state:
            if state["sketch_counts"].shape != self.sketch.counts.shape:
                raise ValueError(
                    f"sketch_counts: expected {tuple(self.sketch.counts.shape)}, "
                    f"got {tuple(state['sketch_counts'].shape)}"
                )
            self.sketch.counts = state["sketch_counts"].to(torch.int32).clone()
            self.sketch.sightings = int(state["sketch_sightings"])
