"""Small gRPC helpers shared by this project's servers (embedding servers, the serving process)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import grpc


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_insecure(server: grpc.Server, host: str, port: int, field: str) -> int:
    """Binds ``host:port`` (0: any free port) and returns the bound port; ``OSError`` naming the
    config ``field`` when the address cannot be bound (grpc reports that as port 0 or an error)."""
    address = format_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"{field}: cannot bind {address}: {e}") from None
    if bound == 0:
        raise OSError(f"{field}: cannot bind {address}")
    return bound


def serve_until_signal(start: Callable[[], str], announce: Callable[[str], None] | None) -> None:
    """Runs ``start()`` (which returns the ready line), announces it, and blocks until SIGTERM
    or SIGINT. The line goes to stdout by default: a parent process waits for it."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    line = start()
    if announce is None:
        print(line, flush=True)
    else:
        announce(line)
    while not done.wait(0.5):  # a timed wait keeps the main thread responsive to signals
        pass
