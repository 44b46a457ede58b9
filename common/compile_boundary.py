"""Functions that ``torch.compile`` runs eagerly, without importing ``torch._dynamo`` until a
compile needs it.

``torch.compiler.disable`` imports ``torch._dynamo`` when it decorates: 1.7 s of every process
start on a 2-core host (a shard server, a router, each CLI command that loads a model), although
a server never compiles. :func:`eager_under_compile` leaves that import to ``torch.compile``,
which performs it before it traces anything: while ``torch._dynamo`` is not loaded nothing is
being compiled, and the function runs as it is; once it is loaded, calls go through
``torch._dynamo.disable`` as before."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def eager_under_compile(fn: F) -> F:
    """``fn`` with ``torch.compiler.disable``'s meaning (dynamo never traces into it: a call
    from a compiled graph is a graph break that runs ``fn`` eagerly), minus the import cost."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        return dynamo.disable(fn)
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:  # no compile has started in this process
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(dynamo.disable(fn))
        return disabled[0](*args, **kwargs)

    # what dynamo reads to graph-break at a call instead of inlining it (torch.compiler.disable
    # sets it on its own wrapper)
    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
