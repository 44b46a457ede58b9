"""Placement planning: the tier, dtype, server split and cache of every table (pure data).

``plan(specs, budgets) -> PlacementPlan`` decides, for each :class:`TableSpec`, a tier (device,
host or remote embedding servers), a storage dtype, how a remote table's S servers split its rows,
and how many hot rows a cache one tier up holds. It does no I/O and needs no torch; applying the
plan (building tables, starting servers) is a separate step. Plans round-trip through JSON and
budgets can be written in TOML with human sizes (``host = "4GiB"``).

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
5. **Cache** last, from the room the tables left, in hotness order, for tables with
   ``expected_hit_rate >= 0.5``: a remote table caches ``ceil(rows * cache_fraction)`` rows in
   host memory; a host table caches as many in device memory when ``has_gpu``. A cache shrinks to
   what fits (possibly 0), so caches never force a narrower dtype.

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
    p.placement("user_id").cache_rows  # 100_000 rows (24.4 MiB) cached in host memory
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields, replace
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, Self

from sharded_tables.specs import DType, TableSpec, Tier

CACHE_MIN_HIT_RATE = 0.5
"""Tables whose ``expected_hit_rate`` is at least this get a hot-row cache."""
PARTITIONS = ("range", "keyed")


class PlanError(ValueError):
    """Invalid planner input, or tables that fit the budgets at no allowed dtype."""


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([+-]?(?:\d[\d_]*(?:\.\d*)?|\.\d+))\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str | int, field: str = "size") -> int:
    """Bytes from an int or a human size: ``"512MiB"``, ``"4GiB"``, ``"1.5GB"``, ``"1_000"``.

    Units are case-insensitive: ``KB MB GB TB`` are powers of 1000, ``KiB MiB GiB TiB`` powers of
    1024; fractions round down to whole bytes. Raises :class:`PlanError` naming ``field``.
    """
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise PlanError(f"{field}: expected a size (int, or str such as '512MiB'), got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.fullmatch(text)
        if m is None or m.group(2).lower() not in _UNITS:
            raise PlanError(
                f"{field}: cannot parse size {text!r}; expected a number with an optional unit "
                "(B, KB, KiB, MB, MiB, GB, GiB, TB, TiB), e.g. '512MiB'"
            )
        value = int(Decimal(m.group(1).replace("_", "")) * _UNITS[m.group(2).lower()])
    if value < 0:
        raise PlanError(f"{field}: size must be >= 0, got {text!r}")
    return value


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units with one decimal: ``"0 B"``, ``"512 B"``, ``"1.5 GiB"``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class _Serde:
    """JSON text and files on top of ``to_dict``/``from_dict``; ``.toml`` files are read only."""

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Self:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"invalid JSON: {e}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Writes JSON (any suffix but ``.toml``, which is a read-only format here)."""
        path = Path(path)
        if path.suffix == ".toml":
            raise PlanError(f"{path}: saved as JSON only; use a .json path")
        path.write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Reads JSON, or TOML when the suffix is ``.toml``; errors name the file."""
        path = Path(path)
        try:
            if path.suffix == ".toml":
                return cls.from_dict(tomllib.loads(path.read_text()))
            return cls.from_json(path.read_text())
        except (PlanError, tomllib.TOMLDecodeError) as e:
            raise PlanError(f"{path}: {e}") from None


def _checked(cls: type, data: Any, where: str) -> dict[str, Any]:
    """``data`` as keyword arguments of dataclass ``cls``: a mapping, no unknown or missing keys."""
    if not isinstance(data, Mapping):
        raise PlanError(f"{where}: expected a table of fields, got {type(data).__name__}")
    known = [f.name for f in fields(cls)]
    for key in data:
        if key not in known:
            raise PlanError(f"{where}.{key}: unknown field (known: {', '.join(known)})")
    for f in fields(cls):
        if f.default is MISSING and f.default_factory is MISSING and f.name not in data:
            raise PlanError(f"{where}.{f.name}: missing")
    return dict(data)


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or any(
        isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value
    ):
        raise PlanError(f"{where}: expected a list of ints >= 0, got {value!r}")
    return tuple(value)


def _count(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError(f"{where}: expected an int >= 0, got {value!r}")


@dataclass(frozen=True)
class Budgets(_Serde):
    """Bytes each tier may use. ``from_dict`` (JSON/TOML) also takes human sizes like ``"4GiB"``."""

    device: int
    """Device memory for tables and, with ``has_gpu``, host-table caches (on CPU: fastest copy)."""
    host: int
    """Host DRAM of the serving process, for tables and remote-table caches."""
    remote_per_server: int = 0
    """DRAM each embedding server may use; remote capacity is ``remote_servers *`` this."""
    remote_servers: int = 0
    """Embedding servers S (0: no remote tier)."""
    cache_fraction: float = 0.05
    """Share of a table's rows its hot-row cache may hold, in ``[0, 1]``."""
    has_gpu: bool = False
    """Whether ``device`` is a real GPU; only then do host tables get device caches."""

    def __post_init__(self) -> None:
        for name in ("device", "host", "remote_per_server", "remote_servers"):
            _count(getattr(self, name), f"budgets.{name}")
        if self.remote_per_server > 0 and self.remote_servers == 0:
            raise PlanError("budgets.remote_servers: must be > 0 when remote_per_server > 0")
        if self.remote_servers > 0 and self.remote_per_server == 0:
            raise PlanError("budgets.remote_per_server: must be > 0 when remote_servers > 0")
        f = self.cache_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 <= f <= 1.0:
            raise PlanError(f"budgets.cache_fraction: expected a number in [0, 1], got {f!r}")
        object.__setattr__(self, "cache_fraction", float(f))
        if not isinstance(self.has_gpu, bool):
            raise PlanError(f"budgets.has_gpu: expected true or false, got {self.has_gpu!r}")

    def capacity(self, tier: Tier) -> int:
        """Bytes of ``tier`` (remote: all servers together)."""
        return {
            Tier.DEVICE: self.device,
            Tier.HOST: self.host,
            Tier.REMOTE: self.remote_servers * self.remote_per_server,
        }[Tier(tier)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "budgets") -> Self:
        kwargs = _checked(cls, data, where)
        for name in ("device", "host", "remote_per_server"):
            if name in kwargs:
                kwargs[name] = parse_bytes(kwargs[name], f"{where}.{name}")
        return cls(**kwargs)


@dataclass(frozen=True)
class TablePlacement(_Serde):
    """Where one table lives, at which dtype, how its remote rows are split, and its cache."""

    table: str
    tier: Tier
    dtype: DType
    bytes: int
    """Bytes reserved for the rows in ``tier``, cache excluded (keyed: ``S * ceil(rows / S)``
    rows)."""
    servers: tuple[int, ...] = ()
    """Remote only: indices of the embedding servers that hold rows."""
    partition: str = ""
    """Remote only: ``"range"`` (contiguous rows per server) or ``"keyed"`` (hashed ids)."""
    row_bounds: tuple[int, ...] = ()
    """Range only: ``servers[i]`` holds rows ``[row_bounds[i], row_bounds[i + 1])``."""
    cache_rows: int = 0
    """Hot rows cached one tier up: remote tables in host memory, host tables on the device."""
    cache_bytes: int = 0
    """Bytes of that cache (``cache_rows`` packed rows at ``dtype``)."""

    def __post_init__(self) -> None:
        where = f"placement {self.table!r}"
        for name, enum in (("tier", Tier), ("dtype", DType)):
            try:
                object.__setattr__(self, name, enum(getattr(self, name)))
            except ValueError:
                choices = ", ".join(e.value for e in enum)
                raise PlanError(
                    f"{where}.{name}: expected one of {choices}, got {getattr(self, name)!r}"
                ) from None
        for name in ("bytes", "cache_rows", "cache_bytes"):
            _count(getattr(self, name), f"{where}.{name}")
        object.__setattr__(self, "servers", _ints(self.servers, f"{where}.servers"))
        object.__setattr__(self, "row_bounds", _ints(self.row_bounds, f"{where}.row_bounds"))
        remote = self.tier is Tier.REMOTE
        if (self.partition in PARTITIONS) != remote or (remote and not self.servers):
            raise PlanError(
                f"{where}.partition: remote tables need servers and 'range' or 'keyed', others "
                f"neither (tier {self.tier.value}, partition {self.partition!r})"
            )
        if not remote and self.servers:
            raise PlanError(f"{where}.servers: only remote tables have servers")
        b = self.row_bounds
        if self.partition == "range":
            ok = len(b) == len(self.servers) + 1 and b[0] == 0 and list(b) == sorted(b)
            if not ok:
                raise PlanError(
                    f"{where}.row_bounds: expected 0 <= ... ascending, one per server + 1"
                )
        elif b:
            raise PlanError(f"{where}.row_bounds: only range-partitioned tables have row bounds")
        if self.cache_rows and self.tier is Tier.DEVICE:
            raise PlanError(f"{where}.cache_rows: device tables have no cache")

    @property
    def cache_tier(self) -> Tier | None:
        """Tier that holds this table's cache (one faster than ``tier``), None for device."""
        return {Tier.REMOTE: Tier.HOST, Tier.HOST: Tier.DEVICE}.get(self.tier)

    def server_bytes(self) -> dict[int, int]:
        """Bytes on each of ``servers`` (empty unless remote)."""
        if self.partition == "keyed":
            return {s: self.bytes // len(self.servers) for s in self.servers}
        if self.partition == "range":
            row_bytes = self.bytes // max(self.row_bounds[-1], 1)
            bounds = zip(self.row_bounds, self.row_bounds[1:], strict=False)
            return {
                s: (hi - lo) * row_bytes for s, (lo, hi) in zip(self.servers, bounds, strict=True)
            }
        return {}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tier=self.tier.value, dtype=self.dtype.value)
        d.update(servers=list(self.servers), row_bounds=list(self.row_bounds))
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "placement") -> Self:
        return cls(**_checked(cls, data, where))


@dataclass(frozen=True)
class PlacementPlan(_Serde):
    """One :class:`TablePlacement` per table (in the order of the specs) and the budgets used."""

    tables: tuple[TablePlacement, ...]
    budgets: Budgets

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        seen: set[str] = set()
        for t in self.tables:
            if t.table in seen:
                raise PlanError(f"tables: table {t.table!r} is placed twice")
            seen.add(t.table)
            if any(s >= self.budgets.remote_servers for s in t.servers):
                raise PlanError(
                    f"placement {t.table!r}.servers: {t.servers} but budgets have "
                    f"{self.budgets.remote_servers} remote servers"
                )

    def placement(self, name: str) -> TablePlacement:
        for t in self.tables:
            if t.table == name:
                return t
        raise KeyError(f"no table {name!r} in plan (tables: {[t.table for t in self.tables]})")

    def usage(self) -> dict[str, int]:
        """Bytes used per tier (caches included) and per remote server (``"remote[s]"``)."""
        use = {tier.value: 0 for tier in Tier}
        use |= {f"remote[{s}]": 0 for s in range(self.budgets.remote_servers)}
        for t in self.tables:
            use[t.tier.value] += t.bytes
            if t.cache_tier is not None:
                use[t.cache_tier.value] += t.cache_bytes
            for s, n in t.server_bytes().items():
                use[f"remote[{s}]"] += n
        return use

    def summary(self) -> str:
        """A table of placements, then used / budget per tier."""
        rows = [("table", "tier", "dtype", "MiB", "servers", "cache rows")]
        for t in self.tables:
            servers = f"{_spans(t.servers)} {t.partition}" if t.servers else "-"
            mib = f"{t.bytes / 2**20:.1f}"
            rows.append((t.table, t.tier.value, t.dtype.value, mib, servers, str(t.cache_rows)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(
                c.rjust(w) if i in (3, 5) else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
            for r in rows
        ]
        use, b = self.usage(), self.budgets
        for tier in Tier:
            cap = format_bytes(b.capacity(tier))
            used = f"{tier.value:<6}  {format_bytes(use[tier.value])} of {cap}"
            if tier is Tier.REMOTE and b.remote_servers:
                used += f" ({b.remote_servers} x {format_bytes(b.remote_per_server)})"
            lines.append(used)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"budgets": self.budgets.to_dict(), "tables": [t.to_dict() for t in self.tables]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        kwargs = _checked(cls, data, "plan")
        if not isinstance(kwargs["tables"], list | tuple):
            raise PlanError("plan.tables: expected a list of placements")
        tables = tuple(
            TablePlacement.from_dict(t, f"plan.tables[{i}]") for i, t in enumerate(kwargs["tables"])
        )
        return cls(tables, Budgets.from_dict(kwargs["budgets"], "plan.budgets"))


def _spans(servers: tuple[int, ...]) -> str:
    """``(0, 1, 2)`` -> ``"0-2"``; ``(0, 2)`` -> ``"0,2"``."""
    if len(servers) > 1 and servers == tuple(range(servers[0], servers[-1] + 1)):
        return f"{servers[0]}-{servers[-1]}"
    return ",".join(map(str, servers))


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
    """Gives skewed remote/host tables a hot-row cache one tier up from the room that is left."""
    fraction = Fraction(str(budgets.cache_fraction))  # exact: ceil(100 * 0.07) must be 7
    for spec in order:
        p = placed[spec.name]
        if spec.expected_hit_rate < CACHE_MIN_HIT_RATE or p.cache_tier is None:
            continue
        if p.cache_tier is Tier.DEVICE and not budgets.has_gpu:
            continue
        row_bytes = spec.row_bytes(p.dtype)
        free = room.host if p.cache_tier is Tier.HOST else room.device
        rows = min(math.ceil(spec.rows * fraction), free // row_bytes)
        if rows == 0:
            continue
        placed[spec.name] = replace(p, cache_rows=rows, cache_bytes=rows * row_bytes)
        if p.cache_tier is Tier.HOST:
            room.host -= rows * row_bytes
        else:
            room.device -= rows * row_bytes


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
