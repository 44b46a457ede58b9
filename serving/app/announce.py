"""The ready line a serving process prints once it takes requests (``common/ready.py``), the
sentence it logs for people, and the addresses both name."""

from __future__ import annotations

from dataclasses import dataclass

from common.ready import ReadyLine, ready_line


@dataclass(frozen=True)
class Addresses:
    grpc: str
    http: str | None
    metrics: str | None


def announce_line(
    model: str, version: int | None, a: Addresses, secured: str, processes: int = 1
) -> str:
    """The sentence for people: ``serving MODEL vVERSION grpc=.. http=.. metrics=..`` (+
    ``processes=N`` for a group, + ``security=..``: which protections are on, never the token).
    Programs read :func:`serving_ready` instead."""
    return (
        f"serving {model} v{version} grpc={a.grpc} http={a.http or 'off'} "
        f"metrics={a.metrics or 'off'}"
        + (f" processes={processes}" if processes > 1 else "")
        + (f" security={secured}" if secured else "")
    )


def serving_ready(
    router: bool, model: str, version: int | None, a: Addresses, secured: str, processes: int = 1
) -> ReadyLine:
    """The ready line of a serving process or group: role ``router`` when it routes to shard
    servers, else ``serve``; the same facts as :func:`announce_line`."""
    return ready_line(
        "router" if router else "serve",
        grpc=a.grpc,
        http=a.http,
        metrics=a.metrics,
        model=model,
        version=version,
        processes=processes,
        security=secured,
    )
