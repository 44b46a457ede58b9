"""The versions of one document shard's part, and the live updates the router applies to them.

A shard server holds its part of the newest ``keep`` versions. Each version moves through the
update sequence of the router's log (``serving/sharding/routed_updates.py``), two phases per
update::

    prepare(v, s, record, attempt)   the part at update s-1 -> the part at update s, built aside
                                     (pending); validates (INVALID_ARGUMENT), reports held items
                                     and statistics
    commit(v, s, attempt)            the pending part of that attempt becomes current; the part at
                                     s-1 is kept beside it, for a router still on s-1 until it
                                     switches (reads never straddle)
    abort(v, s, attempt)             the pending part is dropped (a refused or abandoned update),
                                     and a prepare of that attempt arriving later is refused

An attempt is the router's name for one prepare. A commit names the attempt it commits, so a
prepare that ran late (a replica frozen while the router gave up on it, then resumed) can stand
pending but is never made current: only the next prepare replaces it. Updates are durable only
in the router's log; a shard holds nothing the router did not commit.

A search names (version, sequence) and gets exactly that part, or FAILED_PRECONDITION when this
shard is not there (a restarted shard is at 0 until the router replays its log to it).
Prepare and commit are serialized; searches read an immutable snapshot of ``versions``.

A commit that leaves the part's fresh segment at ``compact_at`` rows or more folds it into the
main lists in the background (``serving.live.compactor.Compactor``, with this class's swap); the
folded part replaces the current one at the same sequence, and the pending prepare is rebased onto
it. Nothing is logged: a shard's updates are durable in the router's log, which catches a shard
restarted after a ``kill -9`` (at any point of a compaction) up to the same state.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError

from retrieval.index.compaction import rebase
from retrieval.index.ivf import IVFIndex
from retrieval.live_shards import ShardUpdate, update_shard
from serving.live.compactor import Compactor
from serving.live.messages import from_record
from serving.protos import admin_pb2

ABORTS_REMEMBERED = 64
"""Aborted attempts a shard remembers (their late prepares are refused); the router aborts at
most a few per update it refuses."""


class PartRefusedError(Exception):
    """A call this shard cannot answer; ``code`` is the gRPC status name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PartVersion:
    """One version of the part: ``index`` after ``sequence`` updates, and ``previous`` (after
    ``sequence - 1``; None at 0); ``attempt``: the prepare committed as ``sequence``."""

    sequence: int
    index: IVFIndex
    previous: IVFIndex | None = None
    attempt: str = ""

    def at(self, sequence: int) -> IVFIndex | None:
        """The part after ``sequence`` updates, when it is held."""
        if sequence == self.sequence:
            return self.index
        if sequence == self.sequence - 1:
            return self.previous
        return None

    def advanced(self, index: IVFIndex, attempt: str) -> PartVersion:
        return PartVersion(self.sequence + 1, index, self.index, attempt)


@dataclass(frozen=True)
class _Pending:
    version: int
    sequence: int
    index: IVFIndex
    attempt: str
    learned_from: dict[str, int]
    """The hashed attributes' sizes before it learned its batch's new values."""

    def named(self, version: int, sequence: int, attempt: str) -> bool:
        """Whether this is the prepare a commit or abort names (an empty ``attempt``: an older
        router, which names only the update)."""
        return (self.version, self.sequence) == (version, sequence) and (
            not attempt or attempt == self.attempt
        )


class ShardParts:
    """Shard ``shard`` of ``num_shards``: its loaded versions and their live updates
    (``compact_at``: the fresh segment's size from which it is folded; 0: never)."""

    def __init__(self, model: str, shard: int, keep: int, compact_at: int = 0):
        self.model, self.shard, self.keep = model, shard, keep
        self.compactor = Compactor(f"shard {shard} of {model!r}", compact_at)
        self.num_shards = 0
        self.versions: dict[int, PartVersion] = {}
        """Loaded versions -> their part; replaced (never mutated) on a change."""
        self._pending: _Pending | None = None
        self._aborted: deque[str] = deque(maxlen=ABORTS_REMEMBERED)
        self._lock = threading.Lock()

    def add(self, version: int, index: IVFIndex, num_shards: int) -> None:
        """Holds a freshly loaded ``version`` (update 0); the oldest beyond ``keep`` goes."""
        with self._lock:
            held = dict(self.versions)
            held[version] = PartVersion(0, index)
            self.versions = {v: held[v] for v in sorted(held)[-self.keep :]}
            self.num_shards = num_shards

    def search_index(self, model: str, version: int, sequence: int) -> tuple[int, IVFIndex]:
        """The part a search names (version 0: the newest) -> (version, part)."""
        held = self.versions  # one snapshot
        self._check_model(model)
        version = version or max(held, default=0)
        part = held.get(version)
        if part is None:
            raise PartRefusedError(
                "FAILED_PRECONDITION",
                f"shard {self.shard} of {self.model!r} holds versions {sorted(held)}, not "
                f"{version}",
            )
        index = part.at(sequence)
        if index is None:
            raise PartRefusedError(
                "FAILED_PRECONDITION",
                f"shard {self.shard} of {self.model!r} v{version} is at update {part.sequence}, "
                f"not {sequence} (the router replays its log to it)",
            )
        return version, index

    def prepare(
        self, model: str, version: int, sequence: int, record: bytes, attempt: str = ""
    ) -> ShardUpdate:
        """Builds the part after update ``sequence`` aside -> the shard's update (held items,
        statistics). The shard must be at ``sequence - 1``; a pending update is replaced. An
        ``attempt`` already aborted is refused (ABORTED): the router gave up on it."""
        with self._lock:
            if attempt and attempt in self._aborted:
                raise PartRefusedError(
                    "ABORTED",
                    f"shard {self.shard}: update {sequence} (attempt {attempt[:40]}) was aborted "
                    "by the router before this prepare ran",
                )
            part = self._part(model, version)
            if sequence != part.sequence + 1:
                raise PartRefusedError(
                    "FAILED_PRECONDITION",
                    f"shard {self.shard} of {self.model!r} v{version} is at update "
                    f"{part.sequence}: update {sequence} needs update {sequence - 1} first",
                )
            self._drop_pending()  # replaced
            try:
                parsed = admin_pb2.LogRecord.FromString(record)
                batch = from_record(parsed, part.index.dim, None)
                done = (
                    ShardUpdate(part.index, torch.zeros(0, dtype=torch.bool))
                    if batch is None
                    else update_shard(part.index, batch, self.shard, self.num_shards)
                )
            except (ValueError, DecodeError) as e:  # a record that does not fit this part
                raise PartRefusedError("INVALID_ARGUMENT", f"update {sequence}: {e}") from None
            self._pending = _Pending(version, sequence, done.index, attempt, done.learned_from)
            return done

    def commit(self, model: str, version: int, sequence: int, attempt: str = "") -> None:
        """Makes the prepare ``attempt`` of update ``sequence`` current (again: a no-op).
        Refused (FAILED_PRECONDITION) when another prepare, or none, is pending."""
        with self._lock:
            part = self._part(model, version)
            pending = self._pending
            if pending is not None and pending.named(version, sequence, attempt):
                held = dict(self.versions)
                held[version] = part.advanced(pending.index, pending.attempt)
                self.versions = held
                self._pending = None
                self.compactor.start(version, pending.index, self._swap_folded)
                return
            if part.sequence == sequence and (not attempt or attempt == part.attempt):
                return  # committed before: a retried commit
            raise PartRefusedError(
                "FAILED_PRECONDITION",
                f"shard {self.shard} of {self.model!r} v{version}: update {sequence} is not "
                "prepared here (by this attempt)",
            )

    def abort(self, version: int, sequence: int, attempt: str = "") -> None:
        """Drops the prepare ``attempt`` of update ``sequence`` of ``version`` if it is pending,
        and refuses that attempt's prepare should it arrive later."""
        with self._lock:
            if attempt and attempt not in self._aborted:
                self._aborted.append(attempt)
            p = self._pending
            if p is not None and p.named(version, sequence, attempt):
                self._drop_pending()

    def _drop_pending(self) -> None:
        """Forgets a pending prepare and the hashed values it learned (the next new value
        takes the position it would have, as on the router and the other shards)."""
        p, self._pending = self._pending, None
        if p is not None:
            p.index.schema.forget(p.learned_from)

    def _swap_folded(self, version: int, base: IVFIndex, folded: IVFIndex) -> bool:
        """Serves ``folded`` (the fold of part ``base`` of ``version``) with what was committed
        since ``base`` rebased onto it, at the current sequence; the pending prepare is rebased
        too, so its commit keeps the fold -> whether it swapped."""
        assert base.live is not None
        with self._lock:
            part = self.versions.get(version)
            if part is None:
                return False
            now = rebase(folded, base.live, part.index)
            if now is None:
                return False
            p = self._pending
            if p is not None and p.version == version:
                ahead = rebase(folded, base.live, p.index)
                if ahead is not None:  # else its commit serves it unfolded: the next one folds
                    self._pending = _Pending(
                        p.version, p.sequence, ahead, p.attempt, p.learned_from
                    )
            held = dict(self.versions)
            held[version] = PartVersion(part.sequence, now, part.previous, part.attempt)
            self.versions = held
            return True

    def sequences(self) -> dict[int, int]:
        """Loaded versions -> their update sequence."""
        return {v: p.sequence for v, p in self.versions.items()}

    def _check_model(self, model: str) -> None:
        if model and model != self.model:
            raise PartRefusedError(
                "FAILED_PRECONDITION",
                f"shard {self.shard} serves model {self.model!r}, not {model!r}",
            )

    def _part(self, model: str, version: int) -> PartVersion:
        self._check_model(model)
        part = self.versions.get(version)
        if part is None:
            raise PartRefusedError(
                "FAILED_PRECONDITION",
                f"shard {self.shard} of {self.model!r} holds versions {sorted(self.versions)}, "
                f"not {version}",
            )
        return part
