"""The ready line: one line of JSON a server prints on stdout once it takes requests.

This is the contract between every server of ours (``recserve serve``, a serving group, a shard
server, an embedding server, the benchmarks' baselines) and whatever starts them (``recserve
cluster``, the benchmarks, the tests, a deploy tool). A server prints it exactly once, after it
binds its ports and reports SERVING, as one line with ``"event": "ready"``::

    {"event": "ready", "role": "serve", "pid": 4242, "grpc": "127.0.0.1:8001",
     "http": "127.0.0.1:8000", "metrics": null, "model": "demo", "version": 3, "processes": 1,
     "security": ""}

(on one line: ``json.dumps`` escapes any newline inside a value). The fields:

* ``role``: what the process serves -- ``serve`` (a model), ``router`` (a model whose index is
  on shard servers), ``shard``, ``embeddings``; a group of processes (``serve --processes N``)
  announces its members' role with ``processes`` N;
* ``pid``: the announcing process (the group's parent for a group);
* ``grpc``, ``http``, ``metrics``: ``host:port`` of each listener with the bound port (never 0),
  ``null`` when that listener is off;
* ``model``, ``version``: what it serves (``null`` where that means nothing, e.g. an embedding
  server given a bare folder);
* ``processes``: processes answering on these ports (1 unless a group);
* ``security``: which protections are on (``tls``, ``token``, ...; never a secret), "" for none;
* any other key is a role's extra (a shard's ``shard``/``num_shards``, an embedding server's
  ``tables``), kept in :attr:`ReadyLine.extras`.

Everything else a server writes (logs) goes to stderr; a reader may still see other lines on the
same stream (a log file that holds both) and skips every line that is not a ready event:
:func:`parse_ready` returns None for them. ``common/process.py`` waits for this line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

log = logging.getLogger(__name__)

EVENT = "ready"

_OPTIONAL_STR = ("grpc", "http", "metrics", "model")


@dataclass(frozen=True)
class ReadyLine:
    """A parsed ready line (see the module docstring for each field)."""

    role: str
    pid: int
    grpc: str | None = None
    http: str | None = None
    metrics: str | None = None
    model: str | None = None
    version: int | None = None
    processes: int = 1
    security: str = ""
    extras: Mapping[str, Any] = field(default_factory=dict)
    """The role's own fields (any key not above), as JSON values."""

    def to_json(self) -> str:
        """The line itself (no newline): the common fields first, then the extras."""
        common = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extras"}
        return json.dumps({"event": EVENT, **common, **self.extras})


_COMMON = frozenset(f.name for f in fields(ReadyLine)) - {"extras"}


def ready_line(role: str, pid: int | None = None, **values: Any) -> ReadyLine:
    """A :class:`ReadyLine` from keyword values: the common fields by name, any other key an
    extra. ``ValueError`` naming the field when a common one has the wrong type, or an extra
    is not JSON."""
    common = {k: v for k, v in values.items() if k in _COMMON}
    extras = {k: v for k, v in values.items() if k not in _COMMON}
    if "event" in extras:
        raise ValueError("event: set by the ready line itself")
    try:
        json.dumps(extras, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extras: not JSON ({e})") from None
    line = ReadyLine(role=role, pid=os.getpid() if pid is None else pid, **common, extras=extras)
    _check(line)
    return line


def announce(role: str, **values: Any) -> ReadyLine:
    """Prints the ready line of :func:`ready_line` ``(role, **values)``; returns it."""
    return print_ready(ready_line(role, **values))


def print_ready(line: ReadyLine) -> ReadyLine:
    """Prints ``line`` on stdout (one write, then flush: it never mixes with a log line on a
    shared file) and logs it on stderr for people; returns it."""
    sys.stdout.write(line.to_json() + "\n")
    sys.stdout.flush()
    log.info("ready: %s", line.to_json())
    return line


def parse_ready(line: str | bytes) -> ReadyLine | None:
    """The ready line in ``line``, or None when ``line`` is not one (a log line, other JSON).
    ``ValueError`` naming the field when it is a ready event with a field of the wrong type: a
    broken contract is reported, not waited out."""
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("event") != EVENT:
        return None
    data.pop("event")
    role, pid = data.pop("role", None), data.pop("pid", None)
    if pid is None:  # ready_line would put this process's own pid in
        raise ValueError("pid: a ready line needs the announcing process's pid")
    return ready_line(role, pid, **data)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(line: ReadyLine) -> None:
    """Each common field has its type (what readers rely on), else ``ValueError`` naming it."""
    if not isinstance(line.role, str) or not line.role:
        raise ValueError(f"role: a non-empty string, got {line.role!r}")
    if not _is_int(line.pid):
        raise ValueError(f"pid: an integer, got {line.pid!r}")
    for name in _OPTIONAL_STR:
        value = getattr(line, name)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name}: a string or null, got {value!r}")
    if line.version is not None and not _is_int(line.version):
        raise ValueError(f"version: an integer or null, got {line.version!r}")
    if not _is_int(line.processes) or line.processes < 1:
        raise ValueError(f"processes: an integer >= 1, got {line.processes!r}")
    if not isinstance(line.security, str):
        raise ValueError(f"security: a string, got {line.security!r}")
