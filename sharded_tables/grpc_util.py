"""Small gRPC helpers shared by this project's servers (embedding servers, the serving process)."""

from __future__ import annotations

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
