"""LiveUpdates: the update logs of one served model, applying and replaying updates (no gRPC).

One update, on the thread that received it (``serving/live/admin.py`` is the gRPC face)::

    host.updating()                   version loads and other updates wait (one at a time)
      parse the message               INVALID_ARGUMENT naming the wire field
      prepare_update(model, batch)    validate all, run the item tower, build the new index;
                                      batches keep running on the old model meanwhile
      log.append(record)              the resolved update, fsync'd: durable from here
      host.swap_updated(...)          wait for the running batch, write table rows, swap
    reply (version, sequence)         acknowledged only once durable and visible

Logs live at ``state_dir/<model>/<version>/updates.log`` (``serving/live/update_log.py``); a
version's log is replayed when the host loads it (``on_load``), before the version serves. A newer
publish starts with an empty log; the logs of versions no longer in the repository are deleted.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from retrieval.index.update import REBUILD_IMBALANCE, list_imbalance
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
from serving.live.messages import from_record, table_widths, to_record, wire_error
from serving.live.update_log import UpdateLog, log_path
from serving.protos import admin_pb2 as pb
from serving.repository.repository import LoadedModel
from serving.types import RequestError

log = logging.getLogger(__name__)


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
    ):
        """``versions()``: the versions the repository still holds (logs of others are deleted)."""
        self.state_dir, self.model, self.metrics = Path(state_dir), model, metrics
        self.versions = versions
        self._logs: dict[int, UpdateLog] = {}
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
        for seq, payload in enumerate(records, start=1):
            try:
                record = pb.LogRecord.FromString(payload)
                if record.sequence != seq:
                    raise ValueError(f"the record says it is update {record.sequence}")
                model = self.replay_record(model, record)
            except Exception as e:
                update_log.close()
                raise RuntimeError(f"{path}: update {seq} does not apply: {e}") from e
        with self._lock:
            self._logs[version] = update_log
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
    ) -> pb.UpdateReply:
        """Validate -> log (fsync) -> apply between batches; -> the reply. ``target``: the
        (model, version) the message names (empty / 0: the one served)."""
        with host.updating() as served:
            host.check_target(target[0], target[1] or None)
            loaded = served.loaded
            batch = parse(loaded.model)
            version = loaded.version
            update_log = self._log(version)
            seq = update_log.count + 1
            with refusals(kind):
                prepared = self.prepare_logged(host, loaded, batch, update_log, seq)
            updated = dataclasses.replace(loaded, model=prepared.model, sequence=seq)
            host.swap_updated(updated, prepared.commit)
            self.metrics.update_applied(kind, seq)
            imbalance, rebuild = self._observe(prepared.model, version)
        return pb.UpdateReply(
            model=self.model,
            version=version,
            sequence=seq,
            items=prepared.model.index.ntotal,
            list_imbalance=imbalance,
            rebuild_recommended=rebuild,
        )

    def prepare_logged(
        self,
        host: ModelHost,
        loaded: LoadedModel,
        batch: UpdateBatch,
        update_log: UpdateLog,
        seq: int,
    ) -> PreparedUpdate:
        """Validates ``batch`` against the served ``loaded`` and logs it as update ``seq``
        (durable once this returns) -> the model to serve and the row writes to commit."""
        prepared = prepare_update(loaded.model, batch, hold=host.gate.exclusive)
        update_log.append(to_record(prepared.resolved, seq).SerializeToString())
        return prepared

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
        if old is not None:
            old.close()

    def _observe(self, model: RetrievalModel, version: int) -> tuple[float, bool]:
        """Sets the list balance gauges; logs when a rebuild becomes worth it."""
        imbalance = list_imbalance(model.index)
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
