"""ServingState: what every front end (gRPC Recommend, KServe v2 gRPC, HTTP) shares.

It holds the engine as a client (``serving/engine/client.py``): the engine in this process
(:class:`~serving.engine.client.InProcessEngine`) or in the engine process of a split group
(``serving/engine/zmq_client.py``); the front ends cannot tell which.

A front end opens a :class:`Call` when a call arrives (:meth:`ServingState.call`), parses its
wire format into :class:`~serving.types.RecRequest` s (one per row) and calls
:meth:`ServingState.submit` (a future per row, for async servers), then closes the call once
with its result or its error: Triton's ``nv_inference_request_success`` / ``_failure`` count
calls, refusals while parsing included, not rows. :meth:`ServingState.recommend` (blocking,
one row) is a whole call. The path of a row:

    draining? -> UNAVAILABLE; limits (filter text, seen lists) -> INVALID_ARGUMENT
    engine.submit: host.current().admit -> Admission (the model's edge: INVALID_ARGUMENT /
      NOT_FOUND), batcher.submit(admission) (RESOURCE_EXHAUSTED when the queue is full)
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
from serving.engine.client import EngineClient, InProcessEngine, row_note
from serving.engine.host import ModelHost
from serving.engine.metrics import ServingMetrics
from serving.engine.pending import PendingUpdates
from serving.engine.runner import Admission, Outcome
from serving.limits import LimitsConfig
from serving.types import (
    DeadlineExceededError,
    RecRequest,
    RecResult,
    RequestError,
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

    def __init__(self, metrics: ServingMetrics, engine: EngineClient):
        self.metrics, self.engine = metrics, engine
        self.start = time.monotonic()
        self.closed = False

    def succeeded(self, version: int) -> None:
        """Answered by model ``version`` (a call whose rows straddle a hot swap: the first's)."""
        self._close(version, None)

    def failed(self, exc: BaseException, reason: str | None = None) -> None:
        """Refused or failed with ``exc``; ``reason`` overrides its ``error_status`` reason (a
        front end's own refusal that has no serving error type)."""
        self._close(self.engine.version, reason or error_status(exc)[2])

    def _close(self, version: int | None, reason: str | None) -> None:
        if not self.closed:
            self.closed = True
            self.metrics.request_done(version, time.monotonic() - self.start, reason)


@dataclass
class ServingState:
    """The engine (as a client), the metrics and the limits of one serving process."""

    engine: EngineClient
    metrics: ServingMetrics
    routed: bool = False
    """A router: the index search runs on document shard servers (no live updates here)."""
    draining: threading.Event = field(default_factory=threading.Event)
    """Set on SIGTERM: health says NOT_SERVING and new requests get UNAVAILABLE."""
    updates: LiveUpdater | None = None
    """Live updates applied in this process (``serving/live/``); None without ``state_dir``, or
    when the engine is another process (then see :attr:`remote_updates`)."""
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    """Request size limits (``[limits]``), checked before a filter is parsed."""
    remote_updates: bool = False
    """The engine is another process with live updates on: the admin API forwards them."""
    pending_updates: PendingUpdates = field(init=False)
    """Admin calls in flight, bounded by ``limits.max_pending_updates`` (back-pressure)."""

    def __post_init__(self) -> None:
        self.pending_updates = PendingUpdates(self.limits.max_pending_updates)

    @property
    def host(self) -> ModelHost:
        """The model host, when the engine runs in this process (the single-process mode)."""
        if not isinstance(self.engine, InProcessEngine):
            raise AttributeError("host: the engine runs in another process")
        return self.engine.host

    @property
    def batcher(self) -> DynamicBatcher[Admission]:
        """The batcher, when the engine runs in this process."""
        if not isinstance(self.engine, InProcessEngine):
            raise AttributeError("batcher: the engine runs in another process")
        return self.engine.batcher

    @property
    def ready(self) -> bool:
        """Ready to take requests: the engine serves a version and this process is not
        draining."""
        return self.engine.ready and not self.draining.is_set()

    def call(self) -> Call:
        """A call arrived: close the :class:`Call` once it is answered or refused."""
        return Call(self.metrics, self.engine)

    def submit(self, req: RecRequest) -> Future[RecResult]:
        """Checks one row at the edge and queues it; raises the serving errors of
        ``serving.types`` (bad input, unknown model, queue full, draining: at once in process,
        through the future from an engine process). Records no request metric: the caller's
        :class:`Call` does, once for all its rows."""
        return self.submit_rows([req])[0]

    def submit_rows(self, reqs: list[RecRequest]) -> list[Future[RecResult]]:
        """:meth:`submit` for the rows of one call: all queued, or none (a refusal names its
        row)."""
        if self.draining.is_set():
            raise UnavailableError("server is draining: not accepting new requests")
        for b, req in enumerate(reqs):
            try:
                self.limits.check_filter_text(req.filter)  # O(1) mostly: before any parsing
                for name in ("seen", "raw_seen"):
                    if (ids := getattr(req, name)) is not None:
                        self.limits.check_seen(len(ids), name)
            except RequestError as e:
                raise RequestError(f"{e}{row_note(b, len(reqs))}") from None
        return self.engine.submit(reqs)

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

    def after_batch() -> None:
        with host.running() as runner:
            runner.between_batches()

    batcher = DynamicBatcher(
        policy,
        run_batch,
        on_batch=lambda waits: metrics.batch_queued(host.version, waits),
        after_batch=after_batch,
        name=f"batcher-{host.name}",
        workers=workers,
    )
    metrics.watch_queue(lambda: batcher.waiting)
    return batcher
