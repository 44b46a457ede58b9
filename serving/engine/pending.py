"""Back-pressure on live updates: a bounded count of admin calls in flight in one process.

Updates apply one at a time (``host.updating()``); a call arriving while others wait queues on
that lock on a gRPC thread. Past ``limits.max_pending_updates`` calls waiting or running, one more
is refused at once with RESOURCE_EXHAUSTED (:class:`~serving.types.QueueFullError`): a client
sending faster than updates apply learns it, and backs off, instead of piling up threads and
deadlines behind the lock::

    pending = PendingUpdates(8)
    with pending.admitted():      # QueueFullError when 8 are in flight
        apply(...)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from serving.types import QueueFullError


class PendingUpdates:
    """At most ``limit`` calls admitted at once (0: no limit)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """Calls admitted and not finished."""
        return self._count

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Admits one call for the ``with`` block; ``QueueFullError`` when ``limit`` are in."""
        with self._lock:
            if self.limit and self._count >= self.limit:
                raise QueueFullError(
                    f"admin: {self._count} updates are already waiting or applying "
                    f"(limits.max_pending_updates = {self.limit}): retry after a back-off"
                )
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
