"""The ready line a serving process prints once it takes requests, and the addresses it names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Addresses:
    grpc: str
    http: str | None
    metrics: str | None


def announce_line(
    model: str, version: int | None, a: Addresses, secured: str, processes: int = 1
) -> str:
    """The ready line: ``serving MODEL vVERSION grpc=.. http=.. metrics=..`` (+ ``processes=N``
    for a group, + ``security=..``: which protections are on, never the token)."""
    return (
        f"serving {model} v{version} grpc={a.grpc} http={a.http or 'off'} "
        f"metrics={a.metrics or 'off'}"
        + (f" processes={processes}" if processes > 1 else "")
        + (f" security={secured}" if secured else "")
    )
