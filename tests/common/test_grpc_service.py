"""add_service / tolerant_deserializer: a service added from its descriptor answers like the
generated registration, except that bytes that are no valid request get INVALID_ARGUMENT
(naming the message type) where gRPC's own deserializer failure is INTERNAL."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from common.grpc_util import MalformedMessage, add_service, bind_port, tolerant_deserializer

SERVICE = "grpc.health.v1.Health"
GARBAGE = b"\xff\xff\xff\xff"  # a field key whose varint never ends
BAD_REQUEST = "request: not a valid grpc.health.v1.HealthCheckRequest message"


class Health(health_pb2_grpc.HealthServicer):
    """Check (unary -> unary) and Watch (unary -> stream); records what each call got."""

    def __init__(self, refuse_itself: bool = False):
        self.got: list[Any] = []
        self.refuse_itself = refuse_itself

    def _take(self, request: Any, context: grpc.ServicerContext) -> None:
        self.got.append(request)
        if isinstance(request, MalformedMessage) and self.refuse_itself:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"mine: {request.message}")

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._take(request, context)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    def Watch(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._take(request, context)
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def serve(servicer: Health, **kw: Any) -> tuple[grpc.Server, grpc.Channel]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    handlers = add_service(server, health_pb2, SERVICE, servicer, **kw)
    assert sorted(handlers) == ["Check", "Watch"]
    port = bind_port(server, "127.0.0.1", 0, "port")
    server.start()
    return server, grpc.insecure_channel(f"127.0.0.1:{port}")


@pytest.fixture(params=[True, False], ids=["refused-here", "refused-by-servicer"])
def service(request) -> Iterator[tuple[Health, grpc.Channel, bool]]:
    refuse_here = request.param
    servicer = Health(refuse_itself=not refuse_here)
    server, channel = serve(servicer, refuse_malformed=refuse_here)
    yield servicer, channel, refuse_here
    channel.close()
    server.stop(0)


def raw(channel: grpc.Channel, method: str, data: bytes) -> Any:
    """Sends ``data`` as the request bytes, unchecked."""
    path = f"/{SERVICE}/{method}"
    if method == "Watch":
        return list(channel.unary_stream(path)(data, timeout=5))
    return channel.unary_unary(path)(data, timeout=5)


def test_valid_requests_are_answered_as_by_the_generated_stub(service) -> None:
    servicer, channel, _ = service
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="x")
    assert stub.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    assert [r.status for r in stub.Watch(request, timeout=5)] == [
        health_pb2.HealthCheckResponse.SERVING
    ]
    assert servicer.got == [request, request]


@pytest.mark.parametrize("method", ["Check", "Watch"])
def test_bytes_that_do_not_parse_are_refused_not_internal(service, method) -> None:
    servicer, channel, refuse_here = service
    with pytest.raises(grpc.RpcError) as err:
        raw(channel, method, GARBAGE)
    if refuse_here:  # the servicer never ran
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert err.value.details().startswith(BAD_REQUEST), err.value.details()
        assert servicer.got == []
    else:  # the servicer got the MalformedMessage and answered in its own way
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
        assert err.value.details().startswith(f"mine: {BAD_REQUEST}"), err.value.details()
        assert servicer.got == [MalformedMessage("grpc.health.v1.HealthCheckRequest")]


def test_a_service_not_in_the_module_is_refused() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(1))
    for name in ("grpc.health.v1.Nope", "other.Health"):
        with pytest.raises(ValueError, match=name):
            add_service(server, health_pb2, name, Health())


parse = tolerant_deserializer(health_pb2.HealthCheckRequest)


@given(st.text(max_size=40))
def test_a_valid_message_parses_to_itself(service_name: str) -> None:
    message = health_pb2.HealthCheckRequest(service=service_name)
    assert parse(message.SerializeToString()) == message


@given(st.binary(max_size=64))
def test_any_bytes_give_a_message_or_a_malformed_one_never_an_exception(data: bytes) -> None:
    got = parse(data)
    assert isinstance(got, health_pb2.HealthCheckRequest | MalformedMessage)
    if isinstance(got, MalformedMessage):
        assert got.message.startswith(BAD_REQUEST)
