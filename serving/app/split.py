"""``recserve serve model --frontends N``: one engine process and N front-end processes.

vLLM's shape (API-server processes apart from one engine core): the **engine** process owns the
model -- one copy, one version, its batcher, hot reload and live updates -- and the **front
ends** (Recommend gRPC, KServe v2 gRPC and HTTP, the admin API) parse, check limits, render and
answer health, sharing the gRPC and HTTP ports with ``SO_REUSEPORT`` as the processes of
``serving/app/processes.py`` do. They meet over ZeroMQ on two IPC sockets in a private folder
(``serving/engine/zmq_engine.py``, ``zmq_client.py``; messages in ``wire.py``): every front
end's rows join the engine's one queue, so batches are formed across all of them, a full queue
answers RESOURCE_EXHAUSTED at the front end, and a publish swaps the engine once.

The parent (this module, a :class:`~serving.app.processes.ProcessGroup`) serves nothing itself:

* starts the engine and the front ends at once; a front end reports ready once the engine
  answers with a loaded version, the parent's ready line once all have;
* restarts a dead front end (the engine and the other front ends go on); restarts a dead
  engine, during which every front end answers UNAVAILABLE (calls waiting on the dead engine
  fail as its socket closes, or after ``zmq_client.ENGINE_TIMEOUT_S`` of silence from a hung
  one: never a hang) and health says NOT_SERVING;
* serves one ``/metrics`` (``metrics_port``): the parent scrapes every process's own registry
  and labels each sample ``process="engine"`` or ``process="<front end>"`` -- the engine's
  batch, queue, model and update metrics, the front ends' request metrics (Triton's counters
  count calls where they are answered);
* on SIGTERM drains the front ends first (each finishes the calls it sent), then the engine.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from common.grpc_util import format_address
from common.stop_signals import StopSignals, exit_on_signals
from serving.app.announce import Addresses
from serving.app.config import ServeConfig
from serving.app.processes import (
    ProcessGroup,
    _Member,
    ready_facts,
    serve_until_stopped,
)

log = logging.getLogger(__name__)

ENGINE = -1
"""The engine's slot among the group's members (front ends are 0..N-1)."""
ENGINE_START_S = 600.0
"""Longest a front end waits for the engine's first version (a kernel build, a big model)."""


def frontends_for(config: ServeConfig) -> int:
    """Front ends to start: as configured, else the cores left after the engine's one."""
    if config.frontends:
        return config.frontends
    return max(1, len(os.sched_getaffinity(0)) - 1)


class SplitGroup(ProcessGroup):
    """The parent of one engine and N front ends (see the module docstring)."""

    def __init__(self, config: ServeConfig):
        super().__init__(config)
        self.folder = Path(tempfile.mkdtemp(prefix="recserve-engine-"))
        self.addresses = (f"ipc://{self.folder}/in", f"ipc://{self.folder}/out")
        self._engine_config = config

    def _configure(self, grpc_port: int, http_port: int | None) -> None:
        cfg = self.config
        metrics = None if cfg.metrics_port is None else 0
        common = {"frontends": None, "processes": 1, "metrics_port": metrics}
        self._engine_config = cfg.model_copy(update={**common, "http_port": None})
        self._child_config = cfg.model_copy(
            update={
                **common,
                "grpc_port": grpc_port,
                "http_port": http_port,
                "torch_threads": 1,
                "poll_s": 0.0,
            }
        )

    def _indices(self) -> list[int]:
        return [ENGINE, *range(frontends_for(self.config))]

    def _target(self, index: int) -> tuple[Any, tuple[Any, ...], str]:
        if index == ENGINE:
            return run_engine, (self._engine_config, self.addresses), "engine"
        return run_frontend, (self._child_config, index, self.addresses), f"frontend-{index}"

    @staticmethod
    def label(index: int) -> str:
        return "engine" if index == ENGINE else str(index)

    def _blocked(self, m: _Member) -> bool:
        """A front end waits for the engine: a dead engine must be restarted first."""
        engine = next(e for e in self._members if e.index == ENGINE)
        return m.index != ENGINE and not engine.process.is_alive()

    def _stop_waves(self) -> list[list[_Member]]:
        front = [m for m in self._members if m.index != ENGINE]
        return [front, [m for m in self._members if m.index == ENGINE]]

    def stop(self) -> bool:
        try:
            return super().stop()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def _logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s [process {name}] %(name)s: %(message)s",
    )


def run_engine(config: ServeConfig, addresses: tuple[str, str], conn: Connection) -> None:
    """The engine process: model host + batcher + :class:`~serving.engine.zmq_engine.EngineLoop`
    until SIGTERM or the parent's end; reports ``("ready", {...})`` or ``("failed", why)``."""
    _logging("engine")
    exit_on_signals(signal.SIGTERM)  # while loading nothing is queued: nothing to drain
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from serving.app.engine_parts import EngineParts
    from serving.engine.metrics import ServingMetrics
    from serving.engine.zmq_engine import EngineLoop
    from serving.repository.repository import ModelRepository

    try:
        config.validate()
        security = config.security.load()
        assert config.model_repo is not None
        repo = ModelRepository(config.model_repo, device=config.device)
        metrics = ServingMetrics(config.model)
        parts = EngineParts(config, repo, metrics, security.upstream)
        engine = parts.start()
        loop = EngineLoop(engine, *addresses, on_update=engine.on_update)
        loop.start()
        metrics_address = None
        if config.metrics_port is not None:
            port = metrics.serve_http(config.metrics_port, config.host)
            metrics_address = format_address(config.host, port)
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        sys.exit(2)
    stop = StopSignals(signal.SIGTERM)
    info = engine.info()
    a = Addresses("", None, metrics_address)
    conn.send(("ready", ready_facts(info.name, info.version, a, security.describe())))
    serve_until_stopped(conn, stop)
    timeout = config.drain_timeout_s
    clean = parts.drain(timeout)  # the front ends drained first: this is what they left
    loop.stop()
    metrics.stop_http()
    parts.close(timeout)
    loop.close()
    sys.stderr.flush()
    os._exit(0 if clean else 1)


def run_frontend(
    config: ServeConfig, index: int, addresses: tuple[str, str], conn: Connection
) -> None:
    """A front-end process: a :class:`~serving.app.server.Server` over a
    :class:`~serving.engine.zmq_client.ZmqEngineClient`, until SIGTERM or the parent's end."""
    _logging(str(index))
    exit_on_signals(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from serving.app.server import Server
    from serving.engine.zmq_client import ZmqEngineClient

    try:
        client = ZmqEngineClient(*addresses, name=f"frontend-{index}-{os.getpid()}")
        client.start()
        if not client.wait_ready(ENGINE_START_S):
            raise RuntimeError(f"the engine did not become ready within {ENGINE_START_S:.0f} s")
        server = Server(config, reuse_port=True, engine=client)
        client.on_ready = server.set_serving
        a = server.start()
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        sys.exit(2)
    stop = StopSignals(signal.SIGTERM)
    info = client.info()
    conn.send(("ready", ready_facts(info.name, info.version, a, server.security.describe())))
    serve_until_stopped(conn, stop)
    clean = server.drain_and_stop()
    sys.stderr.flush()
    os._exit(0 if clean else 1)


def serve_split(config: ServeConfig) -> None:
    """:func:`serving.app.main.serve` with ``frontends`` set: the group until SIGTERM or SIGINT,
    then the front ends drain, then the engine; status 1 when one did not drain in time."""
    from common.stop_signals import serve_until_signal

    group = SplitGroup(config)
    serve_until_signal(group.start)
    log.info("draining the front ends, then the engine (up to %.1f s each)",
             config.drain_timeout_s)  # fmt: skip
    if not group.stop():
        sys.stderr.flush()
        os._exit(1)
    log.info("drained; bye")
