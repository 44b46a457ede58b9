"""Live updates through the router: logged once (here), applied to every document shard in two
phases, all or nothing, and replayed to any shard replica that is behind.

One update (``Admin`` call on the router; ``serving/live/admin.py`` parses it, and
``serving/live/updates.py`` answers a retried ``update_id`` from the log)::

    resolve_update(model, batch)          validate against config, schema, tables; item tower
    until = now + prepare window          update_prepare_ms, cut to PREPARE_SHARE of the caller's time
    sync: every replica at update s-1     replicas behind get the logged updates they miss
    Prepare(v, s, record, attempt)        every replica, by ``until``: each shard builds its
                                          part of update s aside and says which items it held
                                          and its statistics after; once every shard has one
                                          prepared replica, the others get as long again (at
                                          least 1 s), then are aborted and caught up later
      a shard with no replica prepared by ``until``, an item no shard holds, a record a shard
      refuses: Abort(v, s, attempt) to every replica (waiting for none); the update is refused
      (UNAVAILABLE / INVALID_ARGUMENT) and nothing changed anywhere
    caller still waiting?                 else abort: nothing is logged for a caller that left
    log.append(record + statistics)       fsync'd: the commit point, acknowledged from here
    Commit(v, s, attempt) -> prepared     each makes update s searchable (beside s-1)
    swap the router's model               statistics summed over the shards, table rows written;
                                          its searches now name update s

``attempt`` is a fresh name for each prepare: a shard commits only the attempt a Commit names
and refuses a prepare whose attempt it was told to abort, or whose deadline passed before it ran.
So a replica frozen during an update (SIGSTOP, a stalled VM) that resumes after the router gave
up never applies it: its late prepare is refused or stays pending, never committed, and the next
prepare replaces it.

Reads never straddle an update: a search names (version, sequence) and every shard answers from
exactly that state (a shard keeps the part before its last update for the searches still on it).
A replica that missed the commit (down, restarted: a shard server starts at update 0) is refused
by those searches (the router fails over to another replica, or answers partial) until the sync
loop, every ``sync_s``, replays the log to it. A router that crashed after logging an update and
before committing it replays its log on restart and the sync completes the commit on the shards;
one that crashed before logging leaves only prepared parts, replaced by the next Prepare.

The log's records carry the catalog's statistics after each update, so a restarted router
restores its planning statistics without asking the shards. One router owns a model's log.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from retrieval.live_shards import check_held, stats_index
from retrieval.live_updates import (
    AddSeen,
    PreparedUpdate,
    UpdateBatch,
    UpdateEmbeddings,
    apply_update,
    resolve_update,
    with_index,
)
from retrieval.model import RetrievalModel
from serving.engine.host import ModelHost
from serving.engine.metrics import ServingMetrics
from serving.live.messages import from_record, table_widths, to_record
from serving.live.update_log import UpdateLog, log_path, read_log
from serving.live.updates import LiveUpdates, UpdateCall
from serving.protos import admin_pb2
from serving.protos import shard_pb2 as pb
from serving.repository.repository import LoadedModel
from serving.sharding.shard_client import INFO_TIMEOUT_S, ShardClient
from serving.sharding.wire import bytes_tensor, tensor_bytes
from serving.types import RequestError, UnavailableError

log = logging.getLogger(__name__)

PREPARE_SHARE = 0.8
"""Share of the caller's time left that the shards' prepare may take; the rest is for the log's
fsync, the commits and the reply."""
COMMIT_TIMEOUT_S = 5.0
"""Longest wait for one replica's commit (a swap of the prepared part); one that misses it is
caught up by the sync loop."""
STRAGGLER_MIN_S = 1.0
"""Once every shard has prepared an update, its other replicas get at least this long more
(and as long as the prepare took so far) before it goes on without them."""
ABORT_TIMEOUT_S = 5.0
"""Deadline of an abort (nobody waits for it)."""


class RoutedUpdates(LiveUpdates):
    """:class:`LiveUpdates` of a document-sharded model, coordinated by its router."""

    def __init__(
        self,
        state_dir: Path,
        model: str,
        metrics: ServingMetrics,
        client: ShardClient,
        versions: Callable[[], list[int]] | None = None,
        sync_s: float = 1.0,
    ):
        """``client``: the router's channels to every shard replica; ``sync_s``: how often
        replicas that are behind the log are looked for (0: only before each update)."""
        super().__init__(state_dir, model, metrics, versions)
        self.client = client
        self.prepare_s = client.config.update_prepare_ms / 1000.0
        self._shard_lock = threading.Lock()  # one update or sync talks to the shards at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if sync_s > 0:
            self._thread = threading.Thread(
                target=self._sync_loop, args=(sync_s,), name="routed-updates-sync", daemon=True
            )
            self._thread.start()

    # ---- replay (a version loading on the router) ---------------------------------------------
    def replay(self, loaded: LoadedModel) -> LoadedModel:
        loaded = super().replay(loaded)
        with self._shard_lock:  # best effort: the sync loop retries replicas not reached now
            self._sync(loaded.version, loaded.sequence)
        return loaded

    def replay_record(self, model: RetrievalModel, record: admin_pb2.LogRecord) -> RetrievalModel:
        batch = from_record(record, model.index.dim, table_widths(model))
        if isinstance(batch, UpdateEmbeddings | AddSeen):
            return apply_update(model, batch)  # the router's tables and seen store
        sizes, counts = _record_stats(record, model)
        served = int(record.served) or None  # 0: a record from before live segments
        return with_index(model, stats_index(model.index, sizes, counts, batch, served))

    # ---- one update ---------------------------------------------------------------------------
    def prepare_logged(
        self,
        host: ModelHost,
        loaded: LoadedModel,
        batch: UpdateBatch,
        update_log: UpdateLog,
        seq: int,
        call: UpdateCall,
    ) -> PreparedUpdate:
        model, version = loaded.model, loaded.version
        resolved = resolve_update(model, batch, hold=host.gate.exclusive)
        record = to_record(resolved.resolved, seq)
        record.update_id = call.update_id
        until = self._prepare_until(call)
        if not self._shard_lock.acquire(timeout=_left(until)):
            raise UnavailableError(
                f"update {seq} not applied: replaying the log to a replica held the shards past "
                f"this update's prepare deadline ({self.prepare_s:g} s)"
            )
        try:
            self._sync(version, seq - 1, until)
            attempt = uuid.uuid4().hex  # names this prepare on every replica
            prepared = self._prepare(version, seq, attempt, record.SerializeToString(), until)
            try:
                replies = [prepared[s][0][1] for s in sorted(prepared)]  # replicas agree
                held = [_tensor(r.held, np.uint8, "held").bool() for r in replies]
                sizes = torch.stack(
                    [_tensor(r.list_sizes, np.int64, "list_sizes") for r in replies]
                )
                counts = torch.stack(
                    [_tensor(r.bit_counts, np.int64, "bit_counts") for r in replies]
                )
                served = sum(int(r.served) for r in replies)
                check_held(resolved.resolved, held, served)
                index = stats_index(
                    model.index, sizes.sum(0), counts.sum(0), resolved.resolved, served
                )
                record.served = served
                record.list_sizes = tensor_bytes(sizes.sum(0), np.int64)
                record.bit_counts = tensor_bytes(counts.sum(0), np.int64)
                call.check_waiting(seq)  # a caller that gave up would retry it: log nothing
                update_log.append(record.SerializeToString())  # durable: the commit point
            except BaseException:
                self._abort(version, seq, attempt)
                raise
            self._commit(version, seq, attempt, _addresses(prepared))
        finally:
            self._shard_lock.release()
        return PreparedUpdate(with_index(model, index), resolved.resolved, resolved.writes)

    def _prepare_until(self, call: UpdateCall) -> float:
        """When the shards' prepare of an update must be done (``time.monotonic()``): after
        ``prepare_s``, or most of the caller's time, so the caller hears why it failed."""
        window = self.prepare_s
        left = call.left()
        if left is not None:
            window = min(window, PREPARE_SHARE * left)
        return time.monotonic() + window

    def _prepare(
        self, version: int, seq: int, attempt: str, record: bytes, until: float
    ) -> Prepared:
        """Prepare on every replica, by ``until`` -> each shard's answers (in replica order);
        refuses the update (after aborting it everywhere) when a shard refuses it or has no
        replica that prepared it in time."""
        request = pb.PrepareRequest(
            model=self.model, version=version, sequence=seq, record=record, attempt=attempt
        )
        calls = self._call_all("Prepare", request, _left(until))
        late = self._gather(calls, until)
        answers: Prepared = {}
        errors: dict[int, list[str]] = {}
        refused: str | None = None
        for (shard, address), future in calls.items():
            if address in late:
                errors.setdefault(shard, []).append(f"{address}: no answer in time")
                continue
            try:
                reply = future.result()
                answers.setdefault(shard, []).append((address, reply))
            except grpc.RpcError as e:
                why = f"{address}: {e.code().name}: {e.details()}"
                errors.setdefault(shard, []).append(why)
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    refused = f"shard {shard} refuses update {seq}: {e.details()}"
        missing = [s for s in range(self.client.num_shards) if s not in answers]
        if refused is None and not missing:
            if late:  # they never commit this attempt: the sync loop replays it to them
                self._abort(version, seq, attempt, late)
            return answers
        self._abort(version, seq, attempt)
        if refused is not None:
            raise RequestError(refused)
        why = "; ".join(f"shard {s}: {', '.join(errors.get(s, []))}" for s in missing)
        raise UnavailableError(
            f"update {seq} not applied: every shard must take it, and no replica of shard "
            f"{missing[0]} could in time ({why})"
        )

    def _gather(self, calls: dict[tuple[int, str], Future[Any]], until: float) -> list[str]:
        """Waits for the prepare ``calls`` until ``until``, or less once every shard has a
        prepared replica: the others then get as long again as that took (at least
        ``STRAGGLER_MIN_S``), so one frozen replica does not hold every update for the whole
        deadline. -> the addresses still silent (their calls are left to expire)."""
        finished: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        for key, future in calls.items():
            future.add_done_callback(_tell(finished, key))
        started, wait_until = time.monotonic(), until
        silent, prepared = set(calls), set()
        while silent:
            try:
                key = finished.get(timeout=max(wait_until - time.monotonic(), 0.0))
            except queue.Empty:
                break
            silent.discard(key)
            if calls[key].exception() is None:
                prepared.add(key[0])
            if len(prepared) == self.client.num_shards and wait_until == until:
                took = time.monotonic() - started
                wait_until = min(until, time.monotonic() + max(STRAGGLER_MIN_S, took))
        return [address for _, address in silent]

    def _commit(self, version: int, seq: int, attempt: str, addresses: list[str]) -> None:
        """Commits prepare ``attempt`` of update ``seq`` (logged) on the replicas that prepared
        it, waiting at most ``COMMIT_TIMEOUT_S``, even past the caller's deadline (the update is
        durable; a retry with its update_id gets the reply): a replica that misses it is behind,
        its searches of update ``seq`` are refused, and the sync loop replays the update to it."""
        request = pb.CommitRequest(model=self.model, version=version, sequence=seq, attempt=attempt)
        calls = {
            a: self.client.stub(a).Commit.future(request, timeout=COMMIT_TIMEOUT_S)
            for a in addresses
        }
        for address, future in calls.items():
            try:
                future.result()
            except grpc.RpcError as e:
                log.warning(
                    "model %s v%d update %d: Commit on %s failed (%s: %s); it is replayed when "
                    "the replica answers", self.model, version, seq, address, e.code().name,
                    e.details(),
                )  # fmt: skip

    def _abort(
        self, version: int, seq: int, attempt: str, addresses: list[str] | None = None
    ) -> None:
        """Aborts prepare ``attempt`` of update ``seq`` on ``addresses`` (None: every replica),
        waiting for none: a replica that prepared it drops it, one that has not yet (frozen,
        slow) refuses the prepare when it comes, and none ever commits it (a commit names its
        attempt)."""
        request = pb.CommitRequest(model=self.model, version=version, sequence=seq, attempt=attempt)
        every = [a for replicas in self.client.shards for a in replicas]
        for address in every if addresses is None else addresses:
            future = self.client.stub(address).Abort.future(request, timeout=ABORT_TIMEOUT_S)
            future.add_done_callback(self._aborted(version, seq, address))

    def _aborted(self, version: int, seq: int, address: str) -> Callable[[Any], None]:
        def done(future: Any) -> None:
            if future.code() != grpc.StatusCode.OK:
                log.info(
                    "model %s v%d update %d: Abort on %s did not answer (%s); a prepare there "
                    "is never committed", self.model, version, seq, address, future.code().name,
                )  # fmt: skip

        return done

    def _call_all(
        self, method: str, request: Any, timeout: float
    ) -> dict[tuple[int, str], Future[Any]]:
        return {
            (s, a): getattr(self.client.stub(a), method).future(request, timeout=timeout)
            for s, replicas in enumerate(self.client.shards)
            for a in replicas
        }

    # ---- replicas behind the log --------------------------------------------------------------
    def _sync_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                with self._shard_lock:  # the log's length read under the lock updates take
                    with self._lock:
                        logs = {v: lg.count for v, lg in self._logs.items()}
                    for version, count in logs.items():
                        self._sync(version, count)
            except Exception:
                log.exception("model %s: replaying updates to shard replicas failed", self.model)

    def _sync(self, version: int, upto: int, until: float | None = None) -> None:
        """Brings every answering replica holding ``version`` to update ``upto`` by replaying
        the logged updates it misses, by ``until`` (``time.monotonic()``; None: each call gets
        ``prepare_s``). Call with ``_shard_lock`` held and ``upto`` read under it: a replica
        beyond ``upto`` is then beyond the log."""
        if upto <= 0:
            return
        behind: dict[str, int] = {}
        wait = INFO_TIMEOUT_S if until is None else min(INFO_TIMEOUT_S, _left(until))
        for address, info in self.client.infos(wait).items():
            held = dict(zip(info.versions, info.sequences, strict=False))
            at = held.get(version)
            if at is not None and at < upto:
                behind[address] = at
            elif at is not None and at > upto:
                log.error(
                    "model %s v%d: replica %s is at update %d, beyond this router's log (%d): "
                    "another router updates it, or the log was lost",
                    self.model, version, address, at, upto,
                )  # fmt: skip
        if not behind:
            return
        records = read_log(log_path(self.state_dir, self.model, version)).records
        for address, at in behind.items():
            self._replay_to(address, version, at, records[:upto], until)

    def _replay_to(
        self, address: str, version: int, at: int, records: list[bytes], until: float | None
    ) -> None:
        stub = self.client.stub(address)
        try:
            for seq in range(at + 1, len(records) + 1):
                timeout = self.prepare_s if until is None else _left(until)
                key: dict[str, Any] = {"model": self.model, "version": version, "sequence": seq}
                attempt = uuid.uuid4().hex
                stub.Prepare(
                    pb.PrepareRequest(**key, record=records[seq - 1], attempt=attempt),
                    timeout=timeout,
                )
                stub.Commit(pb.CommitRequest(**key, attempt=attempt), timeout=COMMIT_TIMEOUT_S)
        except grpc.RpcError as e:
            log.warning(
                "model %s v%d: replaying updates %d..%d to %s stopped (%s: %s)",
                self.model, version, at + 1, len(records), address, e.code().name, e.details(),
            )  # fmt: skip
            return
        log.info(
            "model %s v%d: replica %s caught up from update %d to %d",
            self.model, version, address, at, len(records),
        )  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=INFO_TIMEOUT_S + self.prepare_s + COMMIT_TIMEOUT_S)
        super().close()


Prepared = dict[int, list[tuple[str, pb.PrepareResponse]]]
"""Shard -> the replicas that prepared an update, with their answers."""


def _tell(
    finished: queue.SimpleQueue[tuple[int, str]], key: tuple[int, str]
) -> Callable[[Any], None]:
    """A future's done callback that puts ``key`` on ``finished``."""
    return lambda _: finished.put(key)


def _left(until: float) -> float:
    """Seconds until ``until`` (``time.monotonic()``), never zero: a gRPC timeout must be positive."""
    return max(until - time.monotonic(), 0.001)


def _addresses(prepared: Prepared) -> list[str]:
    return [a for replies in prepared.values() for a, _ in replies]


def _tensor(data: bytes, dtype: type, field: str) -> torch.Tensor:
    n = len(data) // np.dtype(dtype).itemsize
    return bytes_tensor(data, dtype, (n,), field)


def _record_stats(
    record: admin_pb2.LogRecord, model: RetrievalModel
) -> tuple[torch.Tensor, torch.Tensor]:
    index = model.index
    sizes = bytes_tensor(record.list_sizes, np.int64, (index.nlist,), "list_sizes")
    counts = bytes_tensor(record.bit_counts, np.int64, tuple(index.bit_counts.shape), "bit_counts")
    return sizes, counts
