"""The gRPC front end: ``recserve.serving.v1.Recommender`` + ``grpc.health.v1.Health``.

Other gRPC services (the KServe v2 ``GRPCInferenceService``) join the same server through
``extra_servicers``: callables ``(grpc.Server, ServingState) -> None`` run before it starts.
``security`` (``common/security.py``) adds the bearer-token check to every service and TLS to
the port.

Raw ids (a model with id maps, ``serving/raw_ids.py``): a request may name its history in the
user's own item ids (``raw_history``, text) instead of ``history``; the answer then carries
``raw_item_ids`` beside ``item_ids``. An unknown raw id is INVALID_ARGUMENT naming it.

Seen lists: ``seen`` (dense ids, or ``raw_seen`` in raw ids) names every item the user consumed;
none of them is recommended. The list's length is checked against ``limits.max_seen`` before it
is copied out of the message, then it becomes one ``int64 [S]`` array (no loop over the ids).

Status codes (``serving.types.error_status``): INVALID_ARGUMENT for a bad request (the
message names the field), NOT_FOUND for an unknown model or version, RESOURCE_EXHAUSTED when the
batcher's queue is full, DEADLINE_EXCEEDED when the call's deadline passes first, UNAVAILABLE
while draining. A message over ``max_receive_message_bytes`` is refused by gRPC itself
(RESOURCE_EXHAUSTED) before it reaches a handler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.grpc_util import MalformedMessage, add_service, bind_port, format_address
from common.logs import limit_rate
from common.security import NO_SECURITY, OnRefused, Security
from common.torch_threads import use_process_threads
from serving.engine.state import ServingState
from serving.limits import LimitsConfig
from serving.protos import recommend_pb2 as pb
from serving.protos import recommend_pb2_grpc as pb_grpc
from serving.raw_ids import raw_item_ids
from serving.types import RecRequest, RecResult, RequestError, error_message, error_status

log = limit_rate(logging.getLogger(__name__))

SERVICE = "recserve.serving.v1.Recommender"
MAX_SEND_MESSAGE_BYTES = 16 << 20

ExtraServicer = Callable[[grpc.Server, ServingState], None]


def parse_recommend(
    msg: pb.RecommendRequest | MalformedMessage,
    deadline: float | None,
    limits: LimitsConfig | None = None,
) -> RecRequest:
    """Wire message -> :class:`RecRequest` (shapes and ranges are checked by the runner;
    ``limits``: a seen list's length, before it is copied).

    ``msg`` is a :class:`MalformedMessage` when the bytes did not parse (see
    :func:`add_recommender`): refused like any other bad request."""
    if isinstance(msg, MalformedMessage):
        raise RequestError(msg.message)
    if msg.HasField("user") and msg.user < -1:  # -1: none, as a KServe ``user`` row's -1
        raise RequestError(f"user: a user index is >= 0 (-1: none), got {msg.user}")
    if msg.version < 0:
        raise RequestError(f"version: must be >= 0 (0: the one being served), got {msg.version}")
    raw = None
    if msg.raw_history:
        if msg.history:
            raise RequestError("raw_history: give history or raw_history, not both")
        raw = np.array(list(msg.raw_history), dtype=object)  # [H] str, mapped by the runner
    seen, raw_seen = None, None
    if msg.seen and msg.raw_seen:
        raise RequestError("raw_seen: give seen or raw_seen, not both")
    if msg.seen:
        if limits is not None:
            limits.check_seen(len(msg.seen))
        seen = np.fromiter(msg.seen, dtype=np.int64, count=len(msg.seen))  # [S], in C
    elif msg.raw_seen:
        if limits is not None:
            limits.check_seen(len(msg.raw_seen), "raw_seen")
        raw_seen = np.array(list(msg.raw_seen), dtype=object)  # [S] str, mapped by the runner
    return RecRequest(
        history=np.fromiter(msg.history, dtype=np.int64, count=len(msg.history)),
        categorical=np.fromiter(msg.categorical, dtype=np.int64, count=len(msg.categorical)),
        dense=np.fromiter(msg.dense, dtype=np.float32, count=len(msg.dense)),
        k=int(msg.k),
        filter=msg.filter or None,
        user_id=msg.user_id,
        deadline=deadline,
        model=msg.model,
        version=int(msg.version) or None,
        raw_history=raw,
        seen=seen,
        raw_seen=raw_seen,
        recall_target=float(msg.recall_target),
        user=int(msg.user) if msg.HasField("user") else -1,
    )


def render_recommend(result: RecResult) -> pb.RecommendResponse:
    """The answer; ``raw_item_ids`` too when the answering version has id maps."""
    if result.raw_item_ids is not None:  # rendered by an engine in another process
        raw = result.raw_item_ids.tolist()
    elif result.item_map is not None:
        raw = raw_item_ids(result.item_ids.reshape(1, -1), result.item_map)[0].tolist()
    else:
        raw = []
    return pb.RecommendResponse(
        raw_item_ids=raw,
        item_ids=result.item_ids.tolist(),
        scores=result.scores.tolist(),
        model=result.model,
        version=result.version,
        partial=result.partial,
        missing=result.missing,
    )


def add_recommender(server: grpc.Server, servicer: RecommendServicer) -> None:
    """Adds ``Recommender`` with :func:`common.grpc_util.add_service`: bytes that are no
    ``RecommendRequest`` get INVALID_ARGUMENT (the generated deserializer makes gRPC answer
    INTERNAL). The servicer refuses them itself (:func:`parse_recommend`), so that they are
    counted with the other bad requests."""
    add_service(server, pb, SERVICE, servicer, refuse_malformed=False)


NO_DEADLINE_S = 1e7
"""A remaining time above this (~4 months) is gRPC's way of saying there is no deadline."""


class RecommendServicer(pb_grpc.RecommenderServicer):
    """``Recommend``: parse -> ``state.recommend`` (edge check, batch, wait) -> render."""

    def __init__(self, state: ServingState):
        self.state = state

    def Recommend(
        self, request: pb.RecommendRequest, context: grpc.ServicerContext
    ) -> pb.RecommendResponse:
        # None or ~9.2e18 s: the client set no deadline (grpc reports "infinite" as a huge number)
        remaining = context.time_remaining()
        no_deadline = remaining is None or remaining > NO_DEADLINE_S
        deadline = None if no_deadline else time.monotonic() + remaining
        call = self.state.call()  # counted once: answered, or refused (while parsing too)
        try:
            fut = self.state.submit(parse_recommend(request, deadline, self.state.limits))
            context.add_callback(fut.cancel)  # a caller that goes away leaves the queue
            result = self.state.wait(fut, deadline)
        except Exception as e:
            call.failed(e)
            code, _, _ = error_status(e)
            if code == "INTERNAL":
                log.exception("Recommend failed")
            error = e
        else:
            call.succeeded(result.version)
            return render_recommend(result)
        context.abort(grpc.StatusCode[code], error_message(error))
        raise AssertionError("unreachable: abort raises")


class GrpcServer:
    """One ``grpc.Server`` with Recommend, health checking and any ``extra_servicers``."""

    def __init__(
        self,
        state: ServingState,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        workers: int = 64,
        max_receive_message_bytes: int = 4 << 20,
        extra_servicers: Sequence[ExtraServicer] = (),
        security: Security = NO_SECURITY,
        on_refused: OnRefused | None = None,
        reuse_port: bool = False,
    ):
        """``on_refused``: hears each call the token check refuses (``common.security``)."""
        self.state, self.host, self.port = state, host, port
        self.security = security
        self.health = health.HealthServicer()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="grpc", initializer=use_process_threads
            ),
            interceptors=security.interceptors(on_refused),
            options=[
                ("grpc.max_receive_message_length", max_receive_message_bytes),
                ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
                # a second server on a taken port must fail, unless a process group shares it
                ("grpc.so_reuseport", int(reuse_port)),
            ],
        )
        add_recommender(self._server, RecommendServicer(state))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        for add in extra_servicers:
            add(self._server, state)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def start(self) -> str:
        """Binds and starts; health is SERVING when the state is ready. Returns ``host:port``."""
        creds = self.security.grpc_credentials
        self.port = bind_port(self._server, self.host, self.port, "grpc_port", creds)
        self._server.start()
        self.set_serving(self.state.ready)
        return self.address

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE):
            self.health.set(service, status)

    def drain(self) -> None:
        """Health says NOT_SERVING from now on (load balancers stop sending)."""
        self.health.enter_graceful_shutdown()

    def stop(self, grace: float | None) -> None:
        """Stops accepting calls; in-flight calls get ``grace`` seconds to finish."""
        self._server.stop(grace).wait()
