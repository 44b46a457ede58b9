"""LiveUpdates: the update logs of one served model, applying and replaying updates (no gRPC).

One update, on the thread that received it (``serving/live/admin.py`` is the gRPC face)::

    host.updating()                   version loads and other updates wait (one at a time)
      update_id already logged?       -> that update's reply; nothing changes (a retry)
      parse the message               INVALID_ARGUMENT naming the wire field
      prepare_update(model, batch)    validate all, run the item tower, build the new index;
                                      batches keep running on the old model meanwhile
      caller still waiting?           else DEADLINE_EXCEEDED, nothing logged, nothing changed
      log.append(record)              the resolved update and its update_id, fsync'd: durable
      host.swap_updated(...)          wait for the running batch, write table rows, swap
      compactor.after_update(...)     a live segment past compact_at: folded in the background
    reply (version, sequence)         acknowledged only once durable and visible

An update the client names (``update_id``) is applied at most once per version: the log keeps
the id with the record, so a retried call (its answer lost to a deadline or a dropped connection)
gets the reply of the logged update, after a restart too (the replay rebuilds the replies). The
replies of the last :data:`IDS_REMEMBERED` named updates of a version are held.

Logs live at ``state_dir/<model>/<version>/updates.log`` (``serving/live/update_log.py``); a
version's log is replayed when the host loads it (``on_load``), before the version serves. A newer
publish starts with an empty log; the logs of versions no longer in the repository are deleted.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from retrieval.index import live_index
from retrieval.index.update import REBUILD_IMBALANCE
from retrieval.live_updates import (
    PreparedUpdate,
    UpdateBatch,
    UpdateError,
    apply_update,
    prepare_update,
)
from retrieval.model import RetrievalModel
from serving.engine.host import ModelHost
from serving.engine.metrics import ServingMetrics
from serving.live.compactor import Compactor
from serving.live.messages import from_record, table_widths, to_record, wire_error
from serving.live.update_log import UpdateLog, log_path
from serving.protos import admin_pb2 as pb
from serving.repository.repository import LoadedModel
from serving.types import DeadlineExceededError, RequestError

log = logging.getLogger(__name__)

MAX_UPDATE_ID = 128
"""Longest ``update_id`` a call may give (characters)."""
IDS_REMEMBERED = 65_536
"""Named updates per version whose replies are held for retries (a retry comes within seconds;
each costs ~0.3 KB)."""


@dataclass(frozen=True)
class UpdateCall:
    """The caller of one update: ``update_id`` (its name for the update; empty: none),
    ``deadline`` (``time.monotonic()`` seconds; None: none) and ``gone()``, True once the caller
    stopped waiting (cancelled, or its connection dropped)."""

    update_id: str = ""
    deadline: float | None = None
    gone: Callable[[], bool] = lambda: False

    @classmethod
    def checked(cls, update_id: str, left_s: float | None, gone: Callable[[], bool]) -> UpdateCall:
        """From a call: ``left_s`` its seconds left (None: no deadline); refuses an
        ``update_id`` longer than :data:`MAX_UPDATE_ID` (INVALID_ARGUMENT)."""
        if len(update_id) > MAX_UPDATE_ID:
            raise RequestError(
                f"update_id: at most {MAX_UPDATE_ID} characters, got {len(update_id)}"
            )
        deadline = None if left_s is None else time.monotonic() + left_s
        return cls(update_id, deadline, gone)

    def left(self) -> float | None:
        """Seconds until the caller's deadline (None: none; 0 once passed)."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def check_waiting(self, seq: int) -> None:
        """Raises :class:`DeadlineExceededError` when the caller no longer waits for update
        ``seq``: nothing may be logged for a caller that would not learn of it."""
        if self.gone() or self.left() == 0.0:
            raise DeadlineExceededError(
                f"update {seq} not applied: the caller's deadline passed (or it cancelled) "
                "before the update was logged"
            )


class _Replies:
    """The replies of a version's named updates (update_id -> reply), the newest
    :data:`IDS_REMEMBERED`."""

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, pb.UpdateReply] = OrderedDict()

    def get(self, update_id: str) -> pb.UpdateReply | None:
        return self._by_id.get(update_id) if update_id else None

    def add(self, reply: pb.UpdateReply) -> None:
        if not reply.update_id:
            return
        self._by_id[reply.update_id] = reply
        if len(self._by_id) > IDS_REMEMBERED:
            self._by_id.popitem(last=False)


@contextmanager
def refusals(kind: str) -> Iterator[None]:
    """Model-level refusals -> INVALID_ARGUMENT naming the wire field (``kind``: the call)."""
    try:
        yield
    except UpdateError as e:
        raise wire_error(kind, e) from None
    except ValueError as e:  # checks below the model level (the index's own)
        raise RequestError(str(e)) from None


class LiveUpdates:
    """Update logs of one served model under ``state_dir``; applies and replays updates."""

    def __init__(
        self,
        state_dir: Path,
        model: str,
        metrics: ServingMetrics,
        versions: Callable[[], list[int]] | None = None,
        compact_at: int = 0,
    ):
        """``versions()``: the versions the repository still holds (logs of others are deleted);
        ``compact_at``: the live segment's size from which it is folded into the main lists in
        the background (``serving/live/compactor.py``; 0: never; a server passes
        ``ServeConfig.compact_at``)."""
        self.state_dir, self.model, self.metrics = Path(state_dir), model, metrics
        self.compactor = Compactor(f"model {model}", compact_at)
        self.versions = versions
        self._logs: dict[int, UpdateLog] = {}
        self._replies: dict[int, _Replies] = {}
        self._rebuild = False
        self._lock = threading.Lock()

    def replay(self, loaded: LoadedModel) -> LoadedModel:
        """``ModelHost`` ``on_load``: applies ``loaded``'s log to its model (a torn last record
        is dropped); -> ``loaded`` with the updated model. Raises if a record does not apply."""
        version = loaded.version
        path = log_path(self.state_dir, self.model, version)
        self._close(version)
        update_log, records = UpdateLog.open(path)
        model = loaded.model
        replies = _Replies()
        for seq, payload in enumerate(records, start=1):
            try:
                record = pb.LogRecord.FromString(payload)
                if record.sequence != seq:
                    raise ValueError(f"the record says it is update {record.sequence}")
                model = self.replay_record(model, record)
            except Exception as e:
                update_log.close()
                raise RuntimeError(f"{path}: update {seq} does not apply: {e}") from e
            if record.update_id:  # the reply its call got, for a retry of it
                replies.add(self._reply(model, version, seq, record.update_id))
        with self._lock:
            self._logs[version] = update_log
            self._replies[version] = replies
        if records:
            log.info(
                "model %s v%d: replayed %d updates from %s", self.model, version, len(records), path
            )
        self.metrics.replayed(len(records), len(records))
        self._observe(model, version)
        self._prune(version)
        return dataclasses.replace(loaded, model=model, sequence=len(records))

    def replay_record(self, model: RetrievalModel, record: pb.LogRecord) -> RetrievalModel:
        """One logged update applied to ``model`` -> the model after it."""
        batch = from_record(record, model.index.dim, table_widths(model))
        assert batch is not None  # with the tables' widths, every record is a batch
        return apply_update(model, batch)

    def apply(
        self,
        host: ModelHost,
        kind: str,
        target: tuple[str, int],
        parse: Callable[[RetrievalModel], UpdateBatch],
        call: UpdateCall | None = None,
    ) -> pb.UpdateReply:
        """Validate -> log (fsync) -> apply between batches; -> the reply. ``target``: the
        (model, version) the message names (empty / 0: the one served); ``call``: its caller
        (an ``update_id`` already logged gets that update's reply, and nothing changes)."""
        call = call or UpdateCall()
        with host.updating() as served:
            host.check_target(target[0], target[1] or None)
            loaded = served.loaded
            version = loaded.version
            update_log = self._log(version)
            seq = update_log.count + 1
            with self._lock:
                replies = self._replies.setdefault(version, _Replies())
            done = replies.get(call.update_id)
            if done is not None:
                log.info(
                    "model %s v%d: update_id %.40r is update %d, already applied: answered "
                    "with its reply", self.model, version, call.update_id, done.sequence,
                )  # fmt: skip
                return done
            call.check_waiting(seq)  # it may have queued past its deadline
            batch = parse(loaded.model)
            with refusals(kind):
                prepared = self.prepare_logged(host, loaded, batch, update_log, seq, call)
            updated = dataclasses.replace(loaded, model=prepared.model, sequence=seq)
            host.swap_updated(updated, prepared.commit)
            self.metrics.update_applied(kind, seq)
            self._observe(prepared.model, version)
            self.compactor.after_update(host, prepared.model, version)
            reply = self._reply(prepared.model, version, seq, call.update_id)
            replies.add(reply)
        return reply

    def prepare_logged(
        self,
        host: ModelHost,
        loaded: LoadedModel,
        batch: UpdateBatch,
        update_log: UpdateLog,
        seq: int,
        call: UpdateCall,
    ) -> PreparedUpdate:
        """Validates ``batch`` against the served ``loaded`` and logs it as update ``seq``
        (durable once this returns; not logged when ``call`` stopped waiting) -> the model to
        serve and the row writes to commit."""
        prepared = prepare_update(loaded.model, batch, hold=host.gate.exclusive)
        record = to_record(prepared.resolved, seq)
        record.update_id = call.update_id
        call.check_waiting(seq)
        update_log.append(record.SerializeToString())
        return prepared

    def _reply(
        self, model: RetrievalModel, version: int, seq: int, update_id: str
    ) -> pb.UpdateReply:
        """The reply to update ``seq`` of ``version``; ``model``: the model after it."""
        imbalance = live_index.list_imbalance(model.index)
        return pb.UpdateReply(
            model=self.model,
            version=version,
            sequence=seq,
            items=live_index.served(model.index),
            list_imbalance=imbalance,
            rebuild_recommended=imbalance > REBUILD_IMBALANCE,
            update_id=update_id,
        )

    def close(self) -> None:
        for version in list(self._logs):
            self._close(version)

    def _log(self, version: int) -> UpdateLog:
        with self._lock:
            found = self._logs.get(version)
        if found is None:  # a version loaded without replay (on_load not wired): refuse
            raise RuntimeError(f"model {self.model} v{version}: its update log was not replayed")
        return found

    def _close(self, version: int) -> None:
        with self._lock:
            old = self._logs.pop(version, None)
            self._replies.pop(version, None)
        if old is not None:
            old.close()

    def _observe(self, model: RetrievalModel, version: int) -> tuple[float, bool]:
        """Sets the list balance gauges; logs when a rebuild becomes worth it."""
        imbalance = live_index.list_imbalance(model.index)
        rebuild = imbalance > REBUILD_IMBALANCE
        self.metrics.index_balance(imbalance, rebuild)
        if rebuild and not self._rebuild:
            log.warning(
                "model %s v%d: IVF lists are unbalanced after live updates (largest list %.1fx "
                "the mean, above %.1fx): rebuild the index and publish a new version",
                self.model,
                version,
                imbalance,
                REBUILD_IMBALANCE,
            )
        self._rebuild = rebuild
        return imbalance, rebuild

    def _prune(self, serving: int) -> None:
        """Deletes the logs of versions the repository no longer holds (never served again)."""
        if self.versions is None:
            return
        try:  # housekeeping: a failure here must not refuse the version being loaded
            keep = set(self.versions()) | {serving}
            root = self.state_dir / self.model
            for d in root.iterdir() if root.is_dir() else ():
                if d.is_dir() and d.name.isdigit() and int(d.name) not in keep:
                    self._close(int(d.name))
                    shutil.rmtree(d)
                    log.info("model %s: deleted the update log of retired v%s", self.model, d.name)
        except Exception:
            log.exception("model %s: pruning old update logs failed", self.model)
