"""Placement planning: the tier, dtype, server split and cache of every table (pure data).

``plan(specs, budgets) -> PlacementPlan`` decides, for each :class:`TableSpec`, a tier (device,
host or remote embedding servers), a storage dtype, how a remote table's S servers split its rows,
and how many hot rows a cache one tier up holds. It does no I/O and needs no torch; applying the
plan (building tables, starting servers) is a separate step. The plan's data types and their
JSON/TOML (de)serialization live in :mod:`sharded_tables.placement` and are re-exported here.

Algorithm
---------
1. **Order** tables by hotness density ``lookups_per_sample / row_bytes`` at the table's own dtype
   (the widest the planner uses): hot tables with small rows buy the most lookups per byte of fast
   memory. Ties go by name, so plans are deterministic.
2. **Place** each table whole, in that order, into the fastest tier with room: device, then host,
   then remote. ``device`` is just a budget (on a CPU-only machine, the fastest in-process copy),
   so it is used whenever its budget is > 0.
3. **Remote** rows are split so that no server exceeds ``remote_per_server``:

   * ``range`` (ids ``[0, rows)``): contiguous row ranges by water-filling, i.e. every server gets
     the same share except servers with less free room, which get what they can hold (lower
     indices take the remainder rows); servers given no rows are left out.
   * ``keyed`` (``spec.hashed``): ids are hashed over *all* servers, so each reserves
     ``ceil(rows / S)`` rows.
4. **Narrow** when some table fits nowhere: step the largest table (bytes at its current dtype,
   ties by name) that still has a narrower dtype in ``spec.dtypes()`` down one step and replan
   from scratch. Only when no step is left does :func:`plan` raise :class:`PlanError`, naming the
   tables that did not fit, the free room per tier and the total shortfall.
5. **Cache** last, from the room the tables left (for remote tables: ``budgets.cache`` when it
   is set, else the host room the tables left), in hotness order. First, a range-partitioned
   remote table of at most ``budgets.cache_whole_max`` bytes that fits is cached **whole**
   (``cache_rows = rows``, whatever its skew): its lookups never leave the process, where a
   partial cache of a small table still misses on most requests. Then tables with
   ``expected_hit_rate >= 0.5``: a remote table caches ``ceil(rows * cache_fraction)`` rows in
   host memory; a host table caches as many in device memory when ``has_gpu`` (with its slot
   map, ``SLOT_MAP_BYTES`` per table row). A cache shrinks to what fits (possibly 0), so caches
   never force a narrower dtype.

Example::

    specs = [
        TableSpec("country", rows=200, dim=16),  # 12.5 KiB fp32
        TableSpec("user_id", rows=2_000_000, dim=64, allowed_dtypes=(DType.FP16,)),
    ]
    p = plan(specs, Budgets(device=parse_bytes("1MiB"), host=parse_bytes("64MiB"),
                            remote_per_server=parse_bytes("256MiB"), remote_servers=2))
    p.placement("country").tier       # Tier.DEVICE
    p.placement("user_id").row_bounds  # (0, 1_000_000, 2_000_000): 488 MiB over 2 servers
    p.placement("user_id").dtype       # DType.FP32: fp16 is allowed, but fp32 already fits
    p.placement("user_id").cache_rows  # 200_000 rows (48.8 MiB) cached in host memory
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from sharded_tables.placement import (
    PARTITIONS,
    Budgets,
    PlacementPlan,
    PlanError,
    TablePlacement,
    format_bytes,
    parse_bytes,
)
from sharded_tables.specs import DType, TableSpec, Tier

__all__ = [
    "CACHE_MIN_HIT_RATE",
    "PARTITIONS",
    "SLOT_MAP_BYTES",
    "Budgets",
    "PlacementPlan",
    "PlanError",
    "TablePlacement",
    "format_bytes",
    "parse_bytes",
    "plan",
]

CACHE_MIN_HIT_RATE = 0.5
"""Tables whose ``expected_hit_rate`` is at least this get a hot-row cache."""

SLOT_MAP_BYTES = 4
"""Device memory per **table** row of a host table's device cache: its slot map (``int32``,
``sharded_tables.device_cache``), which a lookup reads by id in fixed shapes."""


@dataclass
class _Room:
    """Free bytes while one attempt places tables (mutable scratch)."""

    device: int
    host: int
    servers: list[int]


def plan(specs: Sequence[TableSpec], budgets: Budgets) -> PlacementPlan:
    """Places every table (see the module docstring); raises :class:`PlanError` if none fits."""
    _validate(specs, budgets)
    order = sorted(specs, key=lambda s: (-s.lookups_per_sample / s.row_bytes(), s.name))
    dtypes = {s.name: s.dtype for s in specs}
    while True:
        placed, missing, room = _attempt(order, dtypes, budgets)
        if not missing:
            break
        steps = [(s, d) for s in specs if (d := _narrower(s, dtypes[s.name])) is not None]
        if not steps:
            raise PlanError(_refusal(missing, dtypes, room))
        largest, narrower = min(
            steps, key=lambda sd: (-sd[0].bytes(dtypes[sd[0].name]), sd[0].name)
        )
        dtypes[largest.name] = narrower
    _add_caches(order, placed, room, budgets)
    return PlacementPlan(tuple(placed[s.name] for s in specs), budgets)


def _validate(specs: Sequence[TableSpec], budgets: Budgets) -> None:
    if not isinstance(budgets, Budgets):
        raise PlanError(f"budgets: expected Budgets, got {type(budgets).__name__}")
    names: set[str] = set()
    for i, s in enumerate(specs):
        if not isinstance(s, TableSpec):
            raise PlanError(f"specs[{i}]: expected TableSpec, got {type(s).__name__}")
        if s.name in names:
            raise PlanError(f"specs[{i}].name: duplicate table name {s.name!r}")
        names.add(s.name)
        if not (math.isfinite(s.lookups_per_sample) and s.lookups_per_sample >= 0):
            raise PlanError(f"table {s.name!r}.lookups_per_sample: expected a finite number >= 0")


def _narrower(spec: TableSpec, dtype: DType) -> DType | None:
    """The next narrower dtype the spec allows after ``dtype``, None at the narrowest."""
    allowed = spec.dtypes()
    i = allowed.index(dtype)
    return allowed[i + 1] if i + 1 < len(allowed) else None


def _attempt(
    order: Sequence[TableSpec], dtypes: Mapping[str, DType], budgets: Budgets
) -> tuple[dict[str, TablePlacement], list[TableSpec], _Room]:
    """Places tables whole, fastest tier first; returns placements, misfits and the room left."""
    room = _Room(budgets.device, budgets.host, [budgets.remote_per_server] * budgets.remote_servers)
    placed: dict[str, TablePlacement] = {}
    missing: list[TableSpec] = []
    for spec in order:
        dtype = dtypes[spec.name]
        size = spec.bytes(dtype)
        if size <= room.device:
            room.device -= size
            placed[spec.name] = TablePlacement(spec.name, Tier.DEVICE, dtype, size)
        elif size <= room.host:
            room.host -= size
            placed[spec.name] = TablePlacement(spec.name, Tier.HOST, dtype, size)
        elif (remote := _place_remote(spec, dtype, room.servers)) is not None:
            placed[spec.name] = remote
        else:
            missing.append(spec)
    return placed, missing, room


def _place_remote(spec: TableSpec, dtype: DType, free: list[int]) -> TablePlacement | None:
    """Splits the rows over servers (taking their room from ``free``), None if they do not fit."""
    if not free:
        return None
    row_bytes = spec.row_bytes(dtype)
    if spec.hashed:
        share = -(-spec.rows // len(free)) * row_bytes
        if min(free) < share:
            return None
        for s in range(len(free)):
            free[s] -= share
        servers = tuple(range(len(free)))
        return TablePlacement(spec.name, Tier.REMOTE, dtype, share * len(free), servers, "keyed")
    rows = _water_fill([f // row_bytes for f in free], spec.rows)
    if rows is None:
        return None
    servers = tuple(s for s, n in enumerate(rows) if n)
    bounds = [0]
    for s in servers:
        bounds.append(bounds[-1] + rows[s])
        free[s] -= rows[s] * row_bytes
    size = spec.rows * row_bytes
    return TablePlacement(spec.name, Tier.REMOTE, dtype, size, servers, "range", tuple(bounds))


def _water_fill(caps: list[int], rows: int) -> list[int] | None:
    """Rows per server: one level for all, capped by each server's ``caps``; None if too few."""
    if sum(caps) < rows:
        return None
    lo, hi = 0, max(caps)  # the smallest level whose capped total reaches ``rows``
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(min(c, mid) for c in caps) >= rows:
            hi = mid
        else:
            lo = mid + 1
    share = [min(c, lo) for c in caps]
    extra = sum(share) - rows  # < servers at the level, so the last of them give one row back
    for s in reversed(range(len(caps))):
        if extra and share[s] == lo:
            share[s] -= 1
            extra -= 1
    return share


def _add_caches(
    order: Sequence[TableSpec], placed: dict[str, TablePlacement], room: _Room, budgets: Budgets
) -> None:
    """Caches small ranged remote tables whole, then gives skewed remote/host tables a hot-row
    cache one tier up, from the room that is left."""
    fraction = Fraction(str(budgets.cache_fraction))  # exact: ceil(100 * 0.07) must be 7
    if budgets.cache is not None:  # remote tables' caches have host room of their own
        room.host = budgets.cache
    for spec in order:
        p = placed[spec.name]
        whole = p.tier is Tier.REMOTE and p.partition == "range"
        if whole and p.bytes <= min(budgets.cache_whole_max, room.host):
            placed[spec.name] = replace(p, cache_rows=spec.rows, cache_bytes=p.bytes)
            room.host -= p.bytes
    for spec in order:
        p = placed[spec.name]
        if p.cache_rows or spec.expected_hit_rate < CACHE_MIN_HIT_RATE or p.cache_tier is None:
            continue
        if p.cache_tier is Tier.DEVICE and not budgets.has_gpu:
            continue
        row_bytes = spec.row_bytes(p.dtype)
        on_host = p.cache_tier is Tier.HOST
        slot_map = 0 if on_host else SLOT_MAP_BYTES * spec.rows
        free = room.host if on_host else room.device - slot_map
        rows = min(math.ceil(spec.rows * fraction), max(free, 0) // row_bytes)
        if rows == 0:
            continue
        size = rows * row_bytes + slot_map
        placed[spec.name] = replace(p, cache_rows=rows, cache_bytes=size)
        if on_host:
            room.host -= size
        else:
            room.device -= size


def _refusal(missing: list[TableSpec], dtypes: Mapping[str, DType], room: _Room) -> str:
    """Names the misfits (at their narrowest dtypes), the room per tier and the shortfall."""
    what = ", ".join(
        f"{s.name!r} ({format_bytes(s.bytes(dtypes[s.name]))} at {dtypes[s.name].value})"
        for s in missing
    )
    if not room.servers:
        remote = "no remote servers"
    elif len(set(room.servers)) == 1:
        remote = f"remote {len(room.servers)} x {format_bytes(room.servers[0])} free"
    else:
        remote = f"remote {format_bytes(sum(room.servers))} free over {len(room.servers)} servers"
    if room.servers:
        remote += f" (largest {format_bytes(max(room.servers))} per server)"
    need = sum(s.bytes(dtypes[s.name]) for s in missing)
    short = need - room.device - room.host - sum(room.servers)
    if short > 0:
        tail = f"short by {format_bytes(short)} ({short} bytes)"
    else:
        tail = "short by 0 B in total, but no single tier (or every server, when keyed) has room"
    return (
        f"cannot place table{'s' if len(missing) > 1 else ''} {what}: "
        f"device {format_bytes(room.device)} free, host {format_bytes(room.host)} free, "
        f"{remote}; {tail}"
    )
