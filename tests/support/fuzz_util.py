"""What the fuzz tests of the serving APIs share (``test_fuzz_*.py``): one in-process server
over the tiny model, a canary thread that sends valid requests during the whole run, and the tiny
model in one word for hypothesis' reports. A module of its own so test modules can import it:
``from fuzz_util import Canary, Quiet, serving``."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings

from serving.app.config import BatchingConfig, ServeConfig
from serving.app.server import Server
from serving.frontends.recommend_grpc import ExtraServicer
from support.tiny_model import StandInRepo, Tiny

WAIT = 10.0


def fuzz_settings(max_examples: int) -> settings:
    """Hypothesis settings of the server fuzz tests: bounded, no deadline per example (a busy
    2-core machine), no example database written into the checkout."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


class Quiet:
    """``tiny`` that prints as one word: hypothesis prints every argument of a failing case, and
    a dataclass field by field (the whole model) whatever its ``__repr__``."""

    def __init__(self, tiny: Tiny):
        self._tiny = tiny

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tiny, name)

    def __repr__(self) -> str:
        return "tiny"


@contextmanager
def serving(
    tiny: Tiny,
    root: Path,
    extra_servicers: Sequence[ExtraServicer] = (),
    *,
    private_model: bool = False,
    **config: Any,
) -> Iterator[Server]:
    """A started server (127.0.0.1, free ports) over ``tiny.model`` as ``demo`` v1, with a model
    repository folder under ``root``; ``private_model``: a copy (live updates write tables in
    place); ``config``: more ``ServeConfig`` fields. Drained and stopped at the end."""
    (root / "demo").mkdir(parents=True)
    (root / "demo" / "config.pbtxt").write_text('name: "demo"\n')
    repo = StandInRepo()
    repo.publish(copy.deepcopy(tiny.model) if private_model else tiny.model)
    base: dict[str, Any] = {
        "model_repo": root,
        "grpc_port": 0,
        "poll_s": 0.0,
        "close_linger_s": 0.0,
        "batching": BatchingConfig(max_batch_size=8, max_queue_delay_ms=1.0),
    }
    server = Server(ServeConfig(**{**base, **config}), repo=repo, extra_servicers=extra_servicers)
    server.start()
    try:
        yield server
    finally:
        server.drain_and_stop(timeout=WAIT)


class Canary(threading.Thread):
    """Calls ``call(n)`` (one valid request; raises when its answer is wrong) every 20 ms until
    :meth:`stop`; counts the calls and keeps every failure."""

    def __init__(self, call: Callable[[int], None]):
        super().__init__(name="canary", daemon=True)
        self.call = call
        self.calls = 0
        self.failures: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.02):
            try:
                self.call(self.calls)
            except Exception as e:
                self.failures.append(repr(e))
            self.calls += 1

    def made(self, calls: int) -> bool:
        """Waits (up to ``WAIT`` s) until it has made ``calls`` calls; whether it has."""
        for _ in range(int(WAIT / 0.01)):
            if self.calls >= calls:
                return True
            self._halt.wait(0.01)
        return self.calls >= calls

    def stop(self) -> None:
        self._halt.set()
        self.join(WAIT)
