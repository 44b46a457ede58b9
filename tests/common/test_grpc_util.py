"""gRPC helpers: a client with ``retry_options`` rides out transient UNAVAILABLE answers; a
server whose drain or exit is stuck still ends (``exit_if_stuck``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent import futures
from pathlib import Path

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


STUCK_EXIT = textwrap.dedent(
    """
    import logging, sys, threading, time
    from common.grpc_util import exit_if_stuck
    logging.basicConfig()
    exit_if_stuck(0.3, "the test drain")

    def handler_that_never_returns():
        threading.Event().wait()

    if sys.argv[1] == "stuck":  # a non-daemon thread: the interpreter's exit waits on it
        threading.Thread(target=handler_that_never_returns).start()
    """
)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["stuck", "clean"])
def test_a_stuck_exit_ends_with_status_1_and_the_stacks_in_the_log(case: str):
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", STUCK_EXIT, case],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if case == "clean":  # ended before the watchdog fired: its own status
        assert out.returncode == 0 and "did not finish" not in out.stderr
        return
    assert out.returncode == 1
    assert "the test drain did not finish within 0.3 s; exiting anyway" in out.stderr
    assert "handler_that_never_returns" in out.stderr  # where it was stuck
