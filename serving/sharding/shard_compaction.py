"""Background compaction of a document shard's fresh segment (``retrieval/index/compaction.py``).

A shard's part grows a live segment with every committed update (``shard_parts.py``); past
``compact_at`` rows (fresh rows plus tombstones) one thread folds a snapshot of it into new main
lists while searches and updates go on, then, holding the parts' lock only for that, rebases
what was committed (and what is prepared) since onto the fold and swaps it in::

    commit s -> segment >= compact_at -> thread: fold(part at s)             no lock held
                                                 parts locked: rebase the part at s' >= s,
                                                 and the pending prepare; swap  O(changes since)

The swapped part keeps its update sequence: it serves the same items, vectors and signatures, so
a router's search naming that sequence is answered the same (up to which lists hold the fresh
rows). Nothing is logged: a shard's updates are durable in the router's log only, and a shard
restarted after a ``kill -9`` (at any point of a compaction) is caught up from it to the same
state (``serving/sharding/routed_updates.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from retrieval.index.compaction import fold
from retrieval.index.ivf import IVFIndex
from serving.live.compactor import HOLD_ENV

log = logging.getLogger(__name__)

Swap = Callable[[int, IVFIndex, IVFIndex], bool]
"""``swap(version, base, folded)``: rebases what changed since ``base`` onto ``folded`` and
serves it -> whether it did (False: the version went, or its part no longer descends from
``base``)."""


class ShardCompactor:
    """Starts at most one compaction at a time for one shard (``compact_at`` <= 0: never)."""

    def __init__(self, what: str, compact_at: int):
        self.what, self.compact_at = what, compact_at
        self._running = threading.Event()
        self.done = 0
        """Compactions swapped in since start."""

    @property
    def running(self) -> bool:
        return self._running.is_set()

    def after_commit(self, version: int, index: IVFIndex, swap: Swap) -> bool:
        """Called with the part a commit left current: folds its segment in the background when
        it has grown to ``compact_at`` and none runs -> whether one started."""
        live = index.live
        if self.compact_at <= 0 or live is None or live.size < self.compact_at:
            return False
        if self._running.is_set():
            return False
        self._running.set()
        threading.Thread(
            target=self._run, args=(version, index, swap), name="shard-compaction", daemon=True
        ).start()
        return True

    def _run(self, version: int, base: IVFIndex, swap: Swap) -> None:
        started = time.monotonic()
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
                log.info("%s v%d: compaction dropped: the part changed", self.what, version)
        except Exception:  # the segment keeps serving; the next commit tries again
            log.exception("%s v%d: compaction failed", self.what, version)
        finally:
            self._running.clear()
