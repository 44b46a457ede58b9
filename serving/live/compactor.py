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
import functools
import logging
import os
import threading
import time
from collections.abc import Callable

from retrieval.index.compaction import fold, rebase
from retrieval.index.ivf import IVFIndex
from retrieval.live_updates import with_index
from retrieval.model import RetrievalModel
from serving.engine.host import ModelHost

log = logging.getLogger(__name__)

HOLD_ENV = "RECSERVE_COMPACT_HOLD_S"
"""Seconds a compaction waits between its fold and its swap (unset: none): how a crash test
holds one mid-way to ``kill -9`` the server there."""


Swap = Callable[[int, IVFIndex, IVFIndex], bool]
"""``swap(version, base, folded)``: rebases what changed since ``base`` onto ``folded`` and
serves it -> whether it did (False: the version went, or what is served no longer descends from
``base``)."""


class Compactor:
    """Starts at most one compaction at a time for one served index (``compact_at`` <= 0:
    never): a served model's (:meth:`after_update`) or a document shard's part (:meth:`start`
    with the shard's own swap)."""

    def __init__(self, what: str, compact_at: int):
        self.what, self.compact_at = what, compact_at
        self._running = threading.Event()
        self.done = 0
        """Compactions swapped in since start."""

    @property
    def running(self) -> bool:
        return self._running.is_set()

    def start(self, version: int, index: IVFIndex, swap: Swap) -> bool:
        """Called with the index an update left served: folds its segment in the background
        when it has grown to ``compact_at`` and none runs -> whether one started."""
        live = index.live
        if self.compact_at <= 0 or live is None or live.size < self.compact_at:
            return False
        if self._running.is_set():
            return False
        self._running.set()
        threading.Thread(
            target=self._run, args=(version, index, swap), name="compaction", daemon=True
        ).start()
        return True

    def after_update(self, host: ModelHost, model: RetrievalModel, version: int) -> bool:
        """:meth:`start` for the model ``host`` serves, swapped in between batches."""
        return self.start(version, model.index, functools.partial(self._swap_served, host))

    def _run(self, version: int, base: IVFIndex, swap: Swap) -> None:
        live = base.live
        assert live is not None
        started = time.monotonic()
        log.info(
            "%s v%d: compaction started: %d fresh rows, %d tombstones",
            self.what, version, live.n, int(live.tombstones.numel()),
        )  # fmt: skip
        try:
            folded = fold(base)
            hold = float(os.environ.get(HOLD_ENV, "") or 0)
            if hold > 0:  # a crash test's window between the fold and the swap
                time.sleep(hold)
            if swap(version, base, folded):
                self.done += 1
                log.info("%s v%d: compaction done in %.2f s: %d items in the main lists",
                         self.what, version, time.monotonic() - started, folded.ntotal)  # fmt: skip
            else:
                log.info("%s v%d: compaction dropped: what is served changed", self.what, version)
        except Exception:  # the segment keeps serving; the next update tries again
            log.exception("%s v%d: compaction failed", self.what, version)
        finally:
            self._running.clear()

    @staticmethod
    def _swap_served(host: ModelHost, version: int, base: IVFIndex, folded: IVFIndex) -> bool:
        """Rebases the updates applied since ``base`` onto ``folded`` under the update lock and
        swaps the model in -> whether it did (False: another version, or the index changed)."""
        assert base.live is not None
        with host.updating() as served:
            loaded = served.loaded
            if loaded.version != version:
                return False
            index = rebase(folded, base.live, loaded.model.index)
            if index is None:
                return False
            host.swap_updated(dataclasses.replace(loaded, model=with_index(loaded.model, index)))
        return True
