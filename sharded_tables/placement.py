"""Placement plan data: budgets, per-table placements, the plan, and their (de)serialization.

A :class:`PlacementPlan` is pure data: one :class:`TablePlacement` per table (tier, storage dtype,
how a remote table's S servers split its rows, hot-row cache size) plus the :class:`Budgets` it
was planned under. Every type validates itself on construction and raises :class:`PlanError`
naming the bad field. Plans and budgets round-trip through JSON (``to_json``/``from_json``,
``save``/``load``); budgets can also be read from TOML with human sizes (``host = "4GiB"``), which
:func:`parse_bytes` reads and :func:`format_bytes` writes back for people.

The algorithm that produces a plan, ``plan(specs, budgets)``, lives in
:mod:`sharded_tables.planner`, which re-exports these names.

Example::

    b = Budgets.from_dict({"device": "1MiB", "host": "64MiB"})
    b.host                                  # 67_108_864
    p = PlacementPlan((TablePlacement("country", Tier.DEVICE, DType.FP32, 12_800),), b)
    PlacementPlan.from_json(p.to_json()) == p  # True
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from decimal import Decimal
from pathlib import Path
from typing import Any, Self

from sharded_tables.specs import DType, Tier

PARTITIONS = ("range", "keyed")
"""How a remote table's rows are split over servers: contiguous ranges, or hashed ids."""


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
    """Host DRAM of the serving process, for tables and (without ``cache``) remote-table caches."""
    remote_per_server: int = 0
    """DRAM each embedding server may use; remote capacity is ``remote_servers *`` this."""
    remote_servers: int = 0
    """Embedding servers S (0: no remote tier)."""
    cache_fraction: float = 0.1
    """Share of a table's rows its hot-row cache may hold, in ``[0, 1]``. Under Zipf-like ids
    a small share of the rows catches most lookups (``bench/cache_hit_rates.py`` measures the
    curve); larger tables do better at the same share."""
    has_gpu: bool = False
    """Whether ``device`` is a real GPU; only then do host tables get device caches."""
    cache: int | None = None
    """Host DRAM reserved for the hot-row caches of remote tables, beside ``host`` (tables never
    use it); None: caches take the host room the tables leave, as before."""
    cache_whole_max: int = 64 << 20
    """A range-partitioned remote table of at most this many bytes is cached whole (all its rows,
    from ``cache`` room): copied once from the embedding servers, its lookups never leave the
    process. 0: never; caches hold ``cache_fraction`` of the rows."""

    def __post_init__(self) -> None:
        for name in ("device", "host", "remote_per_server", "remote_servers", "cache_whole_max"):
            _count(getattr(self, name), f"budgets.{name}")
        if self.cache is not None:
            _count(self.cache, "budgets.cache")
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
            Tier.HOST: self.host + (self.cache or 0),
            Tier.REMOTE: self.remote_servers * self.remote_per_server,
        }[Tier(tier)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "budgets") -> Self:
        kwargs = _checked(cls, data, where)
        for name in ("device", "host", "remote_per_server", "cache", "cache_whole_max"):
            if kwargs.get(name) is not None:
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
    """Hot rows cached one tier up: remote tables in host memory, host tables on the device. All
    the rows of a ranged remote table: cached whole (``sharded_tables.remote_tier``)."""
    cache_bytes: int = 0
    """Bytes of that cache: ``cache_rows`` packed rows at ``dtype`` (a host table's device cache
    also holds its slot map, ``planner.SLOT_MAP_BYTES`` per table row)."""

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
