"""ServingState: what every front end (gRPC Recommend, KServe v2 gRPC, HTTP) shares.

A front end parses its wire format into a :class:`~serving.types.RecRequest` and calls
:meth:`ServingState.submit` (a future, for async servers) or :meth:`ServingState.recommend`
(blocking). Both run the same path and record the same metrics:

    draining? -> UNAVAILABLE
    host.check_target / runner.check (the edge: INVALID_ARGUMENT / NOT_FOUND in microseconds)
    batcher.submit (RESOURCE_EXHAUSTED when the queue is full)
    ... batch: host.current() once, runner.run(reqs) as one forward ...
    the future's result, or its error (see ``serving.types.error_status`` for the codes)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from retrieval.live_updates import UpdateBatch
from retrieval.model import RetrievalModel
from serving.engine.batching import BatchPolicy, DynamicBatcher
from serving.engine.host import ModelHost
from serving.engine.metrics import ServingMetrics
from serving.engine.runner import Outcome
from serving.limits import LimitsConfig
from serving.types import (
    DeadlineExceededError,
    RecRequest,
    RecResult,
    UnavailableError,
    error_status,
)


class LiveUpdater(Protocol):
    """What the admin front end calls to change the live model (``serving.live.updates.
    LiveUpdates``; declared here so the engine needs nothing from the layer above it)."""

    def apply(
        self,
        host: ModelHost,
        kind: str,
        target: tuple[str, int],
        parse: Callable[[RetrievalModel], UpdateBatch],
    ) -> Any:
        """Parses, logs and applies one update to ``host``'s model; -> the reply message (a
        protobuf ``UpdateReply``: the engine leaves wire types to the layer above)."""
        ...


@dataclass
class ServingState:
    """The model host, the batcher and the metrics of one serving process."""

    host: ModelHost
    batcher: DynamicBatcher
    metrics: ServingMetrics
    routed: bool = False
    """A router: the index search runs on document shard servers (no live updates here)."""
    draining: threading.Event = field(default_factory=threading.Event)
    """Set on SIGTERM: health says NOT_SERVING and new requests get UNAVAILABLE."""
    updates: LiveUpdater | None = None
    """Live updates (``serving/live/``); None without ``state_dir``."""
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    """Request size limits (``[limits]``), checked before a filter is parsed."""

    @property
    def model(self) -> str:
        return self.host.name

    @property
    def ready(self) -> bool:
        """Ready to take requests: a version is loaded and the server is not draining."""
        return self.host.ready and not self.draining.is_set()

    def submit(self, req: RecRequest) -> Future[RecResult]:
        """Checks ``req`` at the edge and queues it; raises the serving errors of
        ``serving.types`` at once (bad input, unknown model, queue full, draining)."""
        start = time.monotonic()
        try:
            if self.draining.is_set():
                raise UnavailableError("server is draining: not accepting new requests")
            self.limits.parse_filter(req.filter)  # bounded before the runner parses it
            self.host.check_target(req.model, req.version)
            runner = self.host.current()
            req.checked = (runner, runner.check(req))
            fut = self.batcher.submit(req)
        except Exception as e:
            self.metrics.request_done(
                self.host.version, time.monotonic() - start, error_status(e)[2]
            )
            raise
        fut.add_done_callback(lambda f: self._record(f, start, req.deadline))
        return fut

    def recommend(self, req: RecRequest, timeout: float | None = None) -> RecResult:
        """Blocking :meth:`submit`: waits until the result, ``timeout`` seconds, or the request's
        deadline, whichever is first (then :class:`DeadlineExceededError`)."""
        return self.wait(self.submit(req), req.deadline, timeout)

    def wait(
        self, fut: Future[RecResult], deadline: float | None, timeout: float | None = None
    ) -> RecResult:
        """The result of a :meth:`submit` future, waiting until ``timeout`` or ``deadline``;
        a request still queued then is cancelled (:class:`DeadlineExceededError`)."""
        if deadline is not None:
            left = max(deadline - time.monotonic(), 0.0)
            timeout = left if timeout is None else min(timeout, left)
        try:
            return fut.result(timeout)
        except TimeoutError:
            if fut.done():  # it completed (maybe with DeadlineExceededError) just now
                return fut.result()
            fut.cancel()  # still queued: leaves the queue without running
            raise DeadlineExceededError("deadline: passed before the answer was ready") from None

    def _record(self, fut: Future[Any], start: float, deadline: float | None) -> None:
        now = time.monotonic()
        seconds = now - start
        if fut.cancelled():  # by the caller: it gave up, or its deadline passed
            late = deadline is not None and now >= deadline
            reason = "deadline_exceeded" if late else "cancelled"
            self.metrics.request_done(self.host.version, seconds, reason)
            return
        exc = fut.exception()
        if exc is None:
            self.metrics.request_done(fut.result().version, seconds, None)
        else:
            self.metrics.request_done(self.host.version, seconds, error_status(exc)[2])


def make_batcher(
    host: ModelHost, policy: BatchPolicy, metrics: ServingMetrics, workers: int = 1
) -> DynamicBatcher:
    """The engine loop over ``host``: each batch reads ``host.current()`` once, inside
    ``host.running()``, so a hot swap or a live update takes effect between batches."""

    def run_batch(reqs: list[RecRequest]) -> list[Outcome]:
        with host.running() as runner:  # a live update waits for this batch, then swaps
            start = time.monotonic()
            out = runner.run(reqs)
        metrics.batch_computed(runner.version, len(reqs), time.monotonic() - start)
        return out

    batcher = DynamicBatcher(
        policy,
        run_batch,
        on_batch=lambda waits: metrics.batch_queued(host.version, waits),
        name=f"batcher-{host.name}",
        workers=workers,
    )
    metrics.watch_queue(lambda: batcher.waiting)
    return batcher
