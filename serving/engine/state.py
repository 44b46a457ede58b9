"""ServingState: what every front end (gRPC Recommend, KServe v2 gRPC, HTTP) shares.

A front end opens a :class:`Call` when a call arrives (:meth:`ServingState.call`), parses its
wire format into :class:`~serving.types.RecRequest` s (one per row) and calls
:meth:`ServingState.submit` (a future per row, for async servers), then closes the call once
with its result or its error: Triton's ``nv_inference_request_success`` / ``_failure`` count
calls, refusals while parsing included, not rows. :meth:`ServingState.recommend` (blocking,
one row) is a whole call. The path of a row:

    draining? -> UNAVAILABLE
    host.current().admit -> Admission (the edge: INVALID_ARGUMENT / NOT_FOUND in microseconds)
    batcher.submit(admission) (RESOURCE_EXHAUSTED when the queue is full)
    ... batch: host.current() once, runner.run(admissions) as one forward ...
    the future's result, or its error (see ``serving.types.error_status`` for the codes)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from retrieval.live_updates import UpdateBatch
from retrieval.model import RetrievalModel
from serving.engine.batching import BatchPolicy, DynamicBatcher
from serving.engine.host import ModelHost
from serving.engine.metrics import ServingMetrics
from serving.engine.runner import Admission, Outcome
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
        call: Any = None,
    ) -> Any:
        """Parses, logs and applies one update to ``host``'s model; -> the reply message (a
        protobuf ``UpdateReply``: the engine leaves wire types to the layer above). ``call``:
        its caller (``serving.live.updates.UpdateCall``: update id, deadline)."""
        ...


class Call:
    """One client call — a ``Recommend``, a KServe ``infer`` of B rows — from its arrival to its
    answer or refusal, counted once in the metrics whichever of :meth:`succeeded` /
    :meth:`failed` comes first (a second close is ignored)."""

    def __init__(self, metrics: ServingMetrics, host: ModelHost):
        self.metrics, self.host = metrics, host
        self.start = time.monotonic()
        self.closed = False

    def succeeded(self, version: int) -> None:
        """Answered by model ``version`` (a call whose rows straddle a hot swap: the first's)."""
        self._close(version, None)

    def failed(self, exc: BaseException, reason: str | None = None) -> None:
        """Refused or failed with ``exc``; ``reason`` overrides its ``error_status`` reason (a
        front end's own refusal that has no serving error type)."""
        self._close(self.host.version, reason or error_status(exc)[2])

    def _close(self, version: int | None, reason: str | None) -> None:
        if not self.closed:
            self.closed = True
            self.metrics.request_done(version, time.monotonic() - self.start, reason)


@dataclass
class ServingState:
    """The model host, the batcher and the metrics of one serving process."""

    host: ModelHost
    batcher: DynamicBatcher[Admission]
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

    def call(self) -> Call:
        """A call arrived: close the :class:`Call` once it is answered or refused."""
        return Call(self.metrics, self.host)

    def submit(self, req: RecRequest) -> Future[RecResult]:
        """Checks one row at the edge and queues it; raises the serving errors of
        ``serving.types`` at once (bad input, unknown model, queue full, draining). Records no
        request metric: the caller's :class:`Call` does, once for all its rows."""
        if self.draining.is_set():
            raise UnavailableError("server is draining: not accepting new requests")
        self.limits.check_filter_text(req.filter)  # O(1) mostly: before any parsing
        for name in ("seen", "raw_seen"):
            if (ids := getattr(req, name)) is not None:
                self.limits.check_seen(len(ids), name)
        admission = self.host.current().admit(req, self.limits)  # parses within the limits
        return self.batcher.submit(admission)

    def recommend(self, req: RecRequest, timeout: float | None = None) -> RecResult:
        """One row as a whole call (counted in the metrics): :meth:`submit`, then waits until
        the result, ``timeout`` seconds, or the request's deadline, whichever is first (then
        :class:`DeadlineExceededError`)."""
        call = self.call()
        try:
            result = self.wait(self.submit(req), req.deadline, timeout)
        except BaseException as e:
            call.failed(e)
            raise
        call.succeeded(result.version)
        return result

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
        except CancelledError:
            if deadline is not None and time.monotonic() >= deadline:  # gRPC cancels at it
                raise DeadlineExceededError(
                    "deadline: passed before the answer was ready"
                ) from None
            raise
        except TimeoutError:
            if fut.done():  # it completed (maybe with DeadlineExceededError) just now
                return fut.result()
            fut.cancel()  # still queued: leaves the queue without running
            raise DeadlineExceededError("deadline: passed before the answer was ready") from None


def make_batcher(
    host: ModelHost, policy: BatchPolicy, metrics: ServingMetrics, workers: int = 1
) -> DynamicBatcher[Admission]:
    """The engine loop over ``host``: each batch reads ``host.current()`` once, inside
    ``host.running()``, so a hot swap or a live update takes effect between batches."""

    def run_batch(admitted: list[Admission]) -> list[Outcome]:
        with host.running() as runner:  # a live update waits for this batch, then swaps
            start = time.monotonic()
            out = runner.run(admitted)
        metrics.batch_computed(runner.version, len(admitted), time.monotonic() - start)
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
