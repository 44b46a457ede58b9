"""gRPC helpers: a client with ``retry_options`` rides out transient UNAVAILABLE answers; a
server whose drain or exit is stuck still ends (``exit_if_stuck``)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from common.grpc_util import bind_port, retry_options

METHOD = "/test.Flaky/Call"


class Flaky(grpc.GenericRpcHandler):
    """Answers UNAVAILABLE ``fails`` times, then echoes the request."""

    def __init__(self, fails: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self.fails, self.code, self.calls = fails, code, 0

    def service(self, handler_call_details):
        if handler_call_details.method != METHOD:
            return None

        def call(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.calls += 1
            if self.calls <= self.fails:
                context.abort(self.code, f"try {self.calls} fails")
            return request

        return grpc.unary_unary_rpc_method_handler(call)


@pytest.fixture
def flaky(request):
    handler = Flaky(*request.param)
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = bind_port(server, "127.0.0.1", 0, "port")
    server.start()
    yield handler, f"127.0.0.1:{port}"
    server.stop(0)


def call(address: str, options: list[tuple[str, object]]) -> bytes:
    with grpc.insecure_channel(address, options=options) as channel:
        return channel.unary_unary(METHOD)(b"hi", timeout=5)


@pytest.mark.parametrize("flaky", [(2,)], indirect=True)
def test_unavailable_is_retried_until_an_answer(flaky):
    handler, address = flaky
    assert call(address, retry_options(attempts=3)) == b"hi"
    assert handler.calls == 3


@pytest.mark.parametrize("flaky", [(5,)], indirect=True)
def test_retries_stop_after_the_attempts(flaky):
    handler, address = flaky
    with pytest.raises(grpc.RpcError) as err:
        call(address, retry_options(attempts=3))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and handler.calls == 3


@pytest.mark.parametrize("flaky", [(1, grpc.StatusCode.INVALID_ARGUMENT)], indirect=True)
def test_other_errors_are_not_retried(flaky):
    handler, address = flaky
    with pytest.raises(grpc.RpcError) as err:
        call(address, retry_options())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and handler.calls == 1


def test_one_attempt_is_no_retry_policy():
    with pytest.raises(ValueError, match="attempts"):
        retry_options(attempts=1)
