"""The admin gRPC API (``recserve.admin.v1.Admin``, ``serving/protos/admin.proto``): live
updates of the served model, through :class:`~serving.live.updates.LiveUpdates`.

The API is on only with ``state_dir`` (else every call is FAILED_PRECONDITION saying so); on a
router the updates go through its document shards (``serving/sharding/routed_updates.py``).
With a token configured, a call needs it before it gets here (``common/security.py``: admin
methods always need the token, even with ``auth_serving`` off); the :data:`Authorizer` hook is
for finer rules on top.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from common.grpc_util import MalformedMessage, add_service
from retrieval.index import live_index
from retrieval.live_updates import RemoveItems, UpdateBatch
from retrieval.model import RetrievalModel
from serving.engine.client import UpdateHandler
from serving.engine.host import ModelHost
from serving.engine.state import LiveUpdater, ServingState
from serving.limits import LimitsConfig
from serving.live.messages import (
    CallBounds,
    id_tensor,
    parse_add_seen,
    parse_embeddings,
    parse_set_attributes,
    parse_upsert,
    table_widths,
)
from serving.live.updates import UpdateCall
from serving.protos import admin_pb2 as pb
from serving.protos import admin_pb2_grpc as pb_grpc
from serving.types import (
    DeadlineExceededError,
    RequestError,
    UnavailableError,
    error_message,
    error_status,
)

log = logging.getLogger(__name__)

SERVICE = "recserve.admin.v1.Admin"
Authorizer = Callable[[grpc.ServicerContext, str], None]
"""``authorize(context, method)`` runs first in every admin call; raising ``PermissionError``
refuses it (PERMISSION_DENIED). Tokens are checked earlier, by the server's interceptor
(``common/security.py``); the default admits every call that got this far."""


def allow_all(context: grpc.ServicerContext, method: str) -> None:
    """The default :data:`Authorizer`: no rule beyond the server's token check."""


class AdminUnavailableError(RuntimeError):
    """The admin API is off on this server (FAILED_PRECONDITION); the message says why."""


REQUESTS: dict[str, type[Any]] = {
    "upsert_items": pb.UpsertItemsRequest,
    "remove_items": pb.RemoveItemsRequest,
    "set_item_attributes": pb.SetItemAttributesRequest,
    "update_embeddings": pb.UpdateEmbeddingsRequest,
    "add_seen": pb.AddSeenRequest,
}
"""Each update kind's request message (an engine process reads it back from its bytes)."""
REPLY_MARGIN_S = 1.0
"""How long past an update's deadline a front end waits for the engine process's own answer
(DEADLINE_EXCEEDED, or the reply of an update logged just in time)."""


def bounds(m: RetrievalModel, limits: LimitsConfig) -> CallBounds:
    """The ids a call on the served model ``m`` may name (``[limits]``)."""
    users = None if m.seen_store is None else m.seen_store.num_users
    top = live_index.largest_id(m.index)
    known = None if top is None else max(m.config.num_items, top + 1)
    return CallBounds(
        m.config.num_items, limits.max_item_id_growth, users, limits.max_seen_user_growth, known,
    )  # fmt: skip


def parser(
    kind: str, request: Any, limits: LimitsConfig
) -> Callable[[RetrievalModel], UpdateBatch]:
    """``parse(served model) -> UpdateBatch`` of one ``kind`` of call."""
    if kind == "upsert_items":
        return lambda m: parse_upsert(request, m.index.dim, bounds(m, limits))
    if kind == "remove_items":
        return lambda m: RemoveItems(id_tensor(request.ids))
    if kind == "set_item_attributes":
        return lambda m: parse_set_attributes(request)
    if kind == "update_embeddings":
        return lambda m: parse_embeddings(request, table_widths(m))
    if kind == "add_seen":
        return lambda m: parse_add_seen(request, bounds(m, limits))
    raise RequestError(f"update: unknown kind {kind!r}")


def apply_update(
    updates: LiveUpdater,
    host: ModelHost,
    limits: LimitsConfig,
    kind: str,
    request: Any,
    call: UpdateCall,
) -> pb.UpdateReply:
    """One admin call applied to ``host``'s model through ``updates``."""
    target = (request.model, request.version)
    return updates.apply(host, kind, target, parser(kind, request, limits), call)


def update_handler(updates: LiveUpdater, host: ModelHost, limits: LimitsConfig) -> UpdateHandler:
    """The engine process's side of a forwarded update: bytes in (the request), bytes out (the
    reply); the caller's deadline travels with it (whether it is still connected does not)."""

    def handle(kind: str, payload: bytes, update_id: str, deadline: float | None) -> bytes:
        if kind not in REQUESTS:
            raise RequestError(f"update: unknown kind {kind!r}")
        request = REQUESTS[kind].FromString(payload)
        reply = apply_update(updates, host, limits, kind, request, UpdateCall(update_id, deadline))
        return bytes(reply.SerializeToString())

    return handle


class AdminServicer(pb_grpc.AdminServicer):
    """Parses each call, runs it through :meth:`~serving.live.updates.LiveUpdates.apply` (or
    forwards it to the engine process), maps errors to codes."""

    def __init__(self, state: ServingState, authorize: Authorizer = allow_all):
        self.state, self.authorize = state, authorize

    def UpsertItems(
        self, request: pb.UpsertItemsRequest, context: grpc.ServicerContext
    ) -> pb.UpdateReply:
        return self._call(context, "upsert_items", request)

    def RemoveItems(
        self, request: pb.RemoveItemsRequest, context: grpc.ServicerContext
    ) -> pb.UpdateReply:
        return self._call(context, "remove_items", request)

    def SetItemAttributes(
        self, request: pb.SetItemAttributesRequest, context: grpc.ServicerContext
    ) -> pb.UpdateReply:
        return self._call(context, "set_item_attributes", request)

    def UpdateEmbeddings(
        self, request: pb.UpdateEmbeddingsRequest, context: grpc.ServicerContext
    ) -> pb.UpdateReply:
        return self._call(context, "update_embeddings", request)

    def AddSeen(self, request: pb.AddSeenRequest, context: grpc.ServicerContext) -> pb.UpdateReply:
        return self._call(context, "add_seen", request)

    def _check_on(self) -> None:
        if self.state.updates is None and not self.state.remote_updates:
            raise AdminUnavailableError(
                "admin: live updates are off: this server has no state folder (set state_dir "
                "in serve.toml, or --state-dir)"
            )
        if self.state.draining.is_set():
            raise UnavailableError("server is draining: not accepting updates")

    def _call(self, context: grpc.ServicerContext, kind: str, request: Any) -> pb.UpdateReply:
        try:
            self.authorize(context, kind)
            if isinstance(request, MalformedMessage):  # see add_servicer
                raise RequestError(request.message)
            self._check_on()
            call = UpdateCall.checked(request.update_id, _seconds_left(context), _gone(context))
            with self.state.pending_updates.admitted():  # RESOURCE_EXHAUSTED past the bound
                if self.state.updates is None:  # the engine is another process
                    return self._forward(kind, request, call)
                return apply_update(
                    self.state.updates, self.state.host, self.state.limits, kind, request, call
                )
        except Exception as e:
            code, reason = self._status(e)
            if code == "INTERNAL":
                log.exception("admin %s failed", kind)
            self.state.metrics.update_failed(kind, reason)
            error = e
        context.abort(grpc.StatusCode[code], error_message(error))
        raise AssertionError("unreachable: abort raises")

    def _forward(self, kind: str, request: Any, call: UpdateCall) -> pb.UpdateReply:
        """The update applied by the engine process; its reply, or its refusal raised here."""
        fut = self.state.engine.update(
            kind, request.SerializeToString(), call.update_id, call.deadline
        )
        left = call.left()
        try:
            reply = fut.result(None if left is None else left + REPLY_MARGIN_S)
        except TimeoutError:
            fut.cancel()
            raise DeadlineExceededError(
                "deadline: passed before the engine answered the update"
            ) from None
        return pb.UpdateReply.FromString(reply)

    @staticmethod
    def _status(e: Exception) -> tuple[str, str]:
        if isinstance(e, AdminUnavailableError):
            return "FAILED_PRECONDITION", "failed_precondition"
        if isinstance(e, PermissionError):
            return "PERMISSION_DENIED", "permission_denied"
        code, _, reason = error_status(e)
        return code, reason


NO_DEADLINE_S = 1e9
"""gRPC gives a call without a deadline an (almost) infinite one."""


def _seconds_left(context: grpc.ServicerContext) -> float | None:
    left = context.time_remaining()
    return None if left is None or left > NO_DEADLINE_S else float(left)


def _gone(context: grpc.ServicerContext) -> Callable[[], bool]:
    return lambda: not context.is_active()


def add_servicer(
    server: grpc.Server, state: ServingState, authorize: Authorizer = allow_all
) -> None:
    """Adds the ``Admin`` service to ``server`` (registered in ``serving/app/frontends.py``) with
    :func:`common.grpc_util.add_service`: bytes that are no valid message get INVALID_ARGUMENT
    (where the generated deserializer makes gRPC answer INTERNAL). The servicer refuses them
    itself, after ``authorize`` and counted with the other failed updates."""
    add_service(server, pb, SERVICE, AdminServicer(state, authorize), refuse_malformed=False)
