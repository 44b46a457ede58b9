"""Dynamic batching: a pure policy (:class:`BatchPolicy`) and the thread that applies it.

:class:`BatchPolicy` decides from the queue alone — ``(enqueue_time, deadline)`` per waiting
request, oldest first — and the current time; it owns no clock, no lock and no model, so it is
tested exhaustively without either. Its rules (Triton's dynamic batcher):

1. requests whose deadline has passed are dropped (they complete with DEADLINE_EXCEEDED);
2. a full batch (``max_batch_size``) goes at once;
3. otherwise the largest preferred size that the queue can fill goes at once;
4. otherwise everything waiting goes once the oldest request has waited ``max_queue_delay_s``;
   until then the worker sleeps until that moment (or the next arrival).

Admission: a request that finds ``max_queue_size`` requests waiting is refused at once with
:class:`QueueFullError` (RESOURCE_EXHAUSTED on gRPC, HTTP 503: the server is out of capacity,
which is what Triton answers too), so a client sees back-pressure instead of a growing latency.

:class:`DynamicBatcher` is the engine loop: ``submit`` -> queue -> policy -> ``run_batch`` ->
futures. It queues anything with a ``deadline`` (the engine's admitted requests, ``runner.
Admission``; plain requests in tests). ``gate`` (a ``threading.Event``, open by default) holds the worker before it forms a
batch while closed — tests close it to fill the queue deterministically.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from common.logs import limit_rate, safe
from common.torch_threads import use_process_threads
from serving.types import (
    DeadlineExceededError,
    QueueFullError,
    UnavailableError,
    error_status,
)

__all__ = [
    "BatchPolicy",
    "DeadlineExceededError",
    "DynamicBatcher",
    "QueueFullError",
    "Schedule",
    "UnavailableError",
]

log = limit_rate(logging.getLogger(__name__))


class Queued(Protocol):
    """What the batcher reads of a queued item."""

    @property
    def deadline(self) -> float | None:
        """Absolute ``time.monotonic()`` after which the item is dropped (None: never)."""
        ...


Item = TypeVar("Item", bound=Queued)

QueueState = Sequence[tuple[float, float | None]]
"""``(enqueue_time, deadline or None)`` per waiting request, oldest first (monotonic seconds)."""


@dataclass(frozen=True)
class Schedule:
    """What to do now: drop ``expired`` (indices into the queue), then take the first ``take``
    of the requests that remain; when ``take == 0``, sleep until ``wait_until`` (None: until
    the next arrival)."""

    expired: tuple[int, ...]
    take: int
    wait_until: float | None


@dataclass(frozen=True)
class BatchPolicy:
    """Pure batching policy (see the module docstring for the rules)."""

    max_batch_size: int
    """Most requests in one forward (B)."""
    max_queue_delay_s: float
    """Longest the oldest waiting request is held back to grow the batch."""
    max_queue_size: int
    """Most requests waiting; one more is refused (0: no limit)."""
    preferred_sizes: tuple[int, ...] = ()
    """Batch sizes worth sending before the delay is up (each in ``[1, max_batch_size]``)."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {self.max_batch_size}")
        if not self.max_queue_delay_s >= 0:
            raise ValueError(f"max_queue_delay_s: must be >= 0, got {self.max_queue_delay_s}")
        if self.max_queue_size < 0:
            raise ValueError(
                f"max_queue_size: must be >= 0 (0: no limit), got {self.max_queue_size}"
            )
        for p in self.preferred_sizes:
            if not 1 <= p <= self.max_batch_size:
                raise ValueError(
                    f"preferred_sizes: {p} is not in [1, max_batch_size={self.max_batch_size}]"
                )

    def admits(self, waiting: int) -> bool:
        """Whether a new request may join a queue of ``waiting`` requests."""
        return self.max_queue_size == 0 or waiting < self.max_queue_size

    def next_batch(self, queue: QueueState, now: float) -> Schedule:
        """The decision for ``queue`` (oldest first) at time ``now``."""
        expired = tuple(
            i for i, (_, deadline) in enumerate(queue) if deadline is not None and deadline <= now
        )
        live = len(queue) - len(expired)
        if live == 0:
            return Schedule(expired, 0, None)
        if live >= self.max_batch_size:
            return Schedule(expired, self.max_batch_size, None)
        fits = [p for p in self.preferred_sizes if p <= live]
        if fits:
            return Schedule(expired, max(fits), None)
        dropped = set(expired)
        oldest = next(t for i, (t, _) in enumerate(queue) if i not in dropped)
        flush_at = oldest + self.max_queue_delay_s
        if now >= flush_at:
            return Schedule(expired, live, None)
        return Schedule(expired, 0, flush_at)


@dataclass
class _Entry(Generic[Item]):
    item: Item
    future: Future[Any]
    enqueued: float


class DynamicBatcher(Generic[Item]):
    """Thread-safe queue + worker threads forming batches by ``policy``.

    ``workers`` batches may run at once (Triton's model instance count): one is right for a
    model that computes in this process; a router waiting on shards overlaps their round trips.

    ``run_batch(items) -> outcomes`` gets up to ``max_batch_size`` items and returns one
    outcome per item (a result, or an exception the request's future raises).
    ``on_batch(waits)``, when given, hears the queue wait (seconds) of every request of each
    batch before it runs (metrics). ``after_batch()``, when given, runs on the worker once a
    batch's answers are delivered (upkeep that must not delay them, e.g. cache admissions).
    """

    def __init__(
        self,
        policy: BatchPolicy,
        run_batch: Callable[[list[Item]], Sequence[Any]],
        *,
        on_batch: Callable[[list[float]], None] | None = None,
        after_batch: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "batcher",
        start: bool = True,
        workers: int = 1,
    ):
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        self.policy, self.run_batch, self.on_batch, self.clock = policy, run_batch, on_batch, clock
        self.after_batch = after_batch
        self.gate = threading.Event()
        self.gate.set()
        self._queue: deque[_Entry[Item]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._drain = True
        self.batches = 0
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        if start:
            self.start()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def waiting(self) -> int:
        """Requests queued and not yet taken into a batch."""
        with self._cond:
            return len(self._queue)

    def submit(self, item: Item) -> Future[Any]:
        """Queues ``item``; the future gets its result or error. Raises :class:`QueueFullError`
        at once when the queue is full, :class:`UnavailableError` once stopping."""
        fut: Future[Any] = Future()
        with self._cond:
            if self._stopping:
                raise UnavailableError("server is draining: not accepting new requests")
            if not self.policy.admits(len(self._queue)):  # callers that gave up leave room
                self._queue = deque(e for e in self._queue if not e.future.cancelled())
            if not self.policy.admits(len(self._queue)):
                raise QueueFullError(
                    f"queue full: {len(self._queue)} requests waiting "
                    f"(max_queue_size={self.policy.max_queue_size})"
                )
            self._queue.append(_Entry(item, fut, self.clock()))
            self._cond.notify()
        return fut

    def stop(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Refuses new requests; with ``drain`` runs what is queued (no delay), otherwise fails
        it with :class:`UnavailableError`. Returns False when the worker did not finish within
        ``timeout`` seconds."""
        with self._cond:
            self._stopping, self._drain = True, drain
            self._cond.notify()
        self.gate.set()
        until = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            if t.is_alive():
                t.join(None if until is None else max(until - time.monotonic(), 0.0))
        return not any(t.is_alive() for t in self._threads)

    # ---- worker -----------------------------------------------------------------------------
    def _loop(self) -> None:
        use_process_threads()  # the forward runs here: the process's intra-op thread count
        while True:
            self.gate.wait()  # a closed gate holds the worker before it forms a batch
            with self._cond:
                step = self._step()
                if step == "done":
                    self._cond.notify_all()  # the other workers see the stop too
            if step == "done":
                return
            if isinstance(step, list):
                self._execute(step)

    def _step(self) -> list[_Entry[Item]] | str | None:
        """One scheduling step under the lock: a batch to run, "done", or None (waited)."""
        # a cancelled future (the caller gave up) leaves the queue without running
        self._queue = deque(e for e in self._queue if not e.future.cancelled())
        now = self.clock()
        if self._stopping and not self._drain:
            failed, self._queue = list(self._queue), deque()
            for e in failed:
                _fail(e.future, UnavailableError("server stopped before this request ran"))
            return "done"
        plan = self.policy.next_batch([(e.enqueued, e.item.deadline) for e in self._queue], now)
        entries = list(self._queue)
        for i in plan.expired:
            _fail(
                entries[i].future,
                DeadlineExceededError("deadline: passed while the request waited in the queue"),
            )
        dropped = set(plan.expired)
        live = [e for i, e in enumerate(entries) if i not in dropped]
        take = plan.take
        if take == 0 and self._stopping and live:  # draining: no reason to wait for more
            take = min(len(live), self.policy.max_batch_size)
        self._queue = deque(live[take:])
        if take:
            return live[:take]
        if self._stopping:
            return "done"
        timeout = None if plan.wait_until is None else max(plan.wait_until - now, 0.0)
        self._cond.wait(timeout)
        return None

    def _execute(self, entries: list[_Entry[Item]]) -> None:
        entries = [e for e in entries if e.future.set_running_or_notify_cancel()]
        if not entries:
            return
        start = self.clock()
        if self.on_batch is not None:
            try:
                self.on_batch([start - e.enqueued for e in entries])
            except Exception:  # metrics must never stop the worker
                log.exception("on_batch failed")
        try:
            outcomes = list(self.run_batch([e.item for e in entries]))
            if len(outcomes) != len(entries):
                raise RuntimeError(
                    f"run_batch returned {len(outcomes)} outcomes for {len(entries)}"
                )
        except Exception as e:  # the model failed the whole batch: every request hears why
            if error_status(e)[0] == "INTERNAL":  # our bug: the traceback helps
                log.exception("batch of %d failed", len(entries))
            else:  # expected (a router whose shards are all down: UNAVAILABLE): one line
                log.warning("batch of %d failed: %s", len(entries), safe(e))
            for entry in entries:
                entry.future.set_exception(e)
            return
        finally:
            with self._cond:
                self.batches += 1
        for entry, out in zip(entries, outcomes, strict=True):
            if isinstance(out, BaseException):
                entry.future.set_exception(out)
            else:
                entry.future.set_result(out)
        if self.after_batch is not None:
            try:
                self.after_batch()
            except Exception:  # upkeep must never stop the worker
                log.exception("after_batch failed")


def _fail(fut: Future[Any], exc: BaseException) -> None:
    """Completes ``fut`` with ``exc`` unless its caller cancelled it meanwhile."""
    if fut.set_running_or_notify_cancel():
        fut.set_exception(exc)
