"""Background compaction of a served model's fresh segment (``retrieval/index/compaction.py``).

After an update leaves the served index's live segment at ``compact_at`` rows or more (fresh
rows plus tombstones), one thread folds that snapshot into new main lists while requests and
updates go on, then, holding the update lock only for that, rebases the updates that arrived
meanwhile onto it and swaps it in between batches::

    update n applied -> segment >= compact_at -> thread: fold(snapshot)       no lock held
                                                         host.updating():     updates wait
                                                           rebase + swap      O(changes since)

Nothing is logged: the update log stays the record of every acknowledged update, so a kill
during a compaction (at any point) replays to the same items, vectors and signatures.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

from retrieval.index.compaction import fold, rebase
from retrieval.live_updates import with_index
from retrieval.model import RetrievalModel
from serving.engine.host import ModelHost

log = logging.getLogger(__name__)

HOLD_ENV = "RECSERVE_COMPACT_HOLD_S"
"""Seconds a compaction waits between its fold and its swap (unset: none): how a crash test
holds one mid-way to ``kill -9`` the server there."""


class Compactor:
    """Starts at most one compaction at a time for one served model (``compact_at`` <= 0:
    never)."""

    def __init__(self, model: str, compact_at: int):
        self.model, self.compact_at = model, compact_at
        self._running = threading.Event()
        self.done = 0
        """Compactions swapped in since start."""

    @property
    def running(self) -> bool:
        return self._running.is_set()

    def after_update(self, host: ModelHost, model: RetrievalModel, version: int) -> bool:
        """Called with the model an update left served: starts a compaction of its segment when
        it has grown to ``compact_at`` and none runs -> whether one started."""
        live = model.index.live
        if self.compact_at <= 0 or live is None or live.size < self.compact_at:
            return False
        if self._running.is_set():
            return False
        self._running.set()
        threading.Thread(
            target=self._run, args=(host, model, version), name="compaction", daemon=True
        ).start()
        return True

    def _run(self, host: ModelHost, base: RetrievalModel, version: int) -> None:
        try:
            self._compact(host, base, version)
        except Exception:  # the segment keeps serving; the next update tries again
            log.exception("model %s v%d: compaction failed", self.model, version)
        finally:
            self._running.clear()

    def _compact(self, host: ModelHost, base: RetrievalModel, version: int) -> None:
        live = base.index.live
        assert live is not None
        started = time.monotonic()
        log.info(
            "model %s v%d: compaction started: %d fresh rows, %d tombstones",
            self.model, version, live.n, int(live.tombstones.numel()),
        )  # fmt: skip
        folded = fold(base.index)
        hold = float(os.environ.get(HOLD_ENV, "") or 0)
        if hold > 0:
            time.sleep(hold)
        with host.updating() as served:
            loaded = served.loaded
            if loaded.version != version:
                log.info("model %s v%d: compaction dropped: v%d loaded", self.model, version,
                         loaded.version)  # fmt: skip
                return
            index = rebase(folded, live, loaded.model.index)
            if index is None:
                log.info("model %s v%d: compaction dropped: the index changed", self.model, version)
                return
            host.swap_updated(dataclasses.replace(loaded, model=with_index(loaded.model, index)))
        self.done += 1
        kept = 0 if index.live is None else index.live.size
        log.info(
            "model %s v%d: compaction done in %.2f s: %d items in the main lists, %d changes "
            "since in the fresh segment", self.model, version, time.monotonic() - started,
            index.ntotal, kept,
        )  # fmt: skip
