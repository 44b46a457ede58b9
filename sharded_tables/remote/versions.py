"""Which model versions an embedding server holds, and which one to load next (pure bookkeeping).

An embedding server started from a model repository follows publishes: it loads a new version's
rows **beside** the current ones, so that routers mid-rollout read the rows of the version they
serve (``LookupRequest.version``), and keeps at most ``keep`` (2) versions: loading a third drops
the oldest first, so the rows held never exceed old + new.

Example::

    held = HeldVersions(keep=2)
    held.add(1, tables_v1)
    held.get(0) is tables_v1           # 0: the newest
    held.make_room(); held.add(2, tables_v2)
    held.versions()                    # [1, 2]
    held.make_room()                   # [tables_v1]: dropped to make room for version 3
    next_version({1: p1, 2: p2, 3: p3}, held=[2], refused={3})  # None: 3 did not fit
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")

UNVERSIONED = 0
"""The version of rows served from a plain folder: it answers lookups of every version."""


class VersionNotHeldError(LookupError):
    """A lookup named a version the server does not hold (never loaded, or already dropped)."""


class HeldVersions(Generic[T]):
    """``version -> item`` (an item: one version's tables), at most ``keep`` of them.

    Readers (:meth:`get`, :meth:`versions`) take no lock: writers replace the whole mapping.
    """

    def __init__(self, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._held: dict[int, T] = {}
        self._lock = threading.Lock()

    def versions(self) -> list[int]:
        """Held versions, ascending."""
        return sorted(self._held)

    def newest(self) -> int | None:
        return max(self._held, default=None)

    def items(self) -> list[tuple[int, T]]:
        """(version, item) pairs, ascending by version."""
        held = self._held
        return [(v, held[v]) for v in sorted(held)]

    def get(self, version: int) -> T:
        """The item of ``version``; 0: the newest. An unversioned server answers every version."""
        held = self._held  # one snapshot: a concurrent add/drop never tears this read
        if version == UNVERSIONED or UNVERSIONED in held:
            newest = max(held, default=None)
            if newest is None:
                raise VersionNotHeldError("no version loaded")
            return held[newest]
        if version not in held:
            raise VersionNotHeldError(f"version {version} is not held (holds {sorted(held)})")
        return held[version]

    def make_room(self) -> list[T]:
        """Drops the oldest versions until one more fits ``keep``; returns the dropped items."""
        with self._lock:
            held = dict(self._held)
            dropped = [held.pop(v) for v in sorted(held)[: max(0, len(held) - self.keep + 1)]]
            self._held = held
        return dropped

    def add(self, version: int, item: T) -> None:
        """Holds ``item`` as ``version`` (newer than every held one; call :meth:`make_room` first)."""
        with self._lock:
            newest = max(self._held, default=None)
            if newest is not None and version <= newest:
                raise ValueError(f"version {version} is not newer than held version {newest}")
            if len(self._held) >= self.keep:
                raise ValueError(f"already holding {self.keep} versions; make_room() first")
            self._held = {**self._held, version: item}


def next_version(
    available: Mapping[int, object], held: Collection[int], refused: Collection[int]
) -> int | None:
    """The version to load next: the newest ``available`` one newer than every ``held`` one and
    not ``refused`` before (a refused version is not retried; a newer publish is). Skips the
    versions between: a router moves to the newest anyway."""
    newest_held = max(held, default=UNVERSIONED)
    fresh = [v for v in available if v > newest_held]
    if not fresh or max(fresh) in refused:
        return None
    return max(fresh)
