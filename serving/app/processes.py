"""``recserve serve model --processes N``: N serving processes behind one gRPC port and one HTTP port.

One Python process runs one thread of Python at a time (the interpreter lock): its gRPC
handlers, request parsing and rendering, and each batch's many small ops take turns, so one
serving process cannot keep even a 2-core machine busy (``bench/RESULTS.md``). A group of
processes, each a whole :class:`~serving.app.server.Server` (its own model copy, batcher and lock),
shares the listening ports with ``SO_REUSEPORT``: the kernel spreads connections across them
-- the pattern of gRPC's own multiprocessing example and of gunicorn's workers. Batching
happens within each process.

The parent process (this module) serves nothing itself. It

* reserves the ports: a taken port fails at once, naming the field; port 0 picks one free port
  for the whole group; the reserving socket stays bound (never listening) so no stranger can
  take the port between restarts;
* starts the processes (``spawn``) and announces one ready line once every one has loaded and
  warmed its model (``... processes=N``);
* serves ``/metrics`` (``metrics_port``): every process's samples with a ``process`` label;
* restarts a process that dies (more than :data:`RESTARTS_PER_MINUTE` deaths in a minute ends
  the group with status 1: a crash loop is not service);
* on SIGTERM/SIGINT drains them all (each finishes its in-flight requests) and exits 1 when
  one did not drain in time.

A process whose parent dies (kill -9) drains and exits by itself: it watches its pipe to the
parent. Each process polls the repository and hot-swaps on its own, so during a rollout
different connections may see different versions for up to ``poll_s``. Live updates
(``state_dir``) need one process (``ServeConfig.validate`` refuses the mix); ``--frontends``
(``serving/app/split.py``, this class's subclass) serves one model copy to N processes instead.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client import CollectorRegistry, Counter, start_http_server

from common.grpc_util import bind_tcp, format_address
from common.ready import ReadyLine
from common.stop_signals import StopSignals, exit_on_signals, serve_until_signal
from serving.app.announce import Addresses, announce_line, serving_ready
from serving.app.config import ServeConfig
from serving.app.group_metrics import ProcessMetrics
from serving.app.server import Server

log = logging.getLogger(__name__)

RESTARTS_PER_MINUTE = 5
"""Deaths of the group's processes within 60 s after which the group gives up (status 1)."""


class GroupStartError(Exception):
    """A process of the group could not start (its message says why)."""


@dataclass
class _Member:
    """One serving process of the group: slot ``index``, its pipe, and what it reported."""

    index: int
    process: BaseProcess
    conn: Connection
    ready: dict[str, Any] | None = None


def reserve_port(host: str, port: int, field: str) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` and never listening: the group's
    processes bind the same port beside it, nobody else can. Port 0 picks a free port (read
    it back with ``getsockname``). ``OSError`` naming ``field`` when the port is taken --
    checked without ``SO_REUSEPORT`` first, so another group cannot silently join."""
    if port:
        bind_tcp(host, port, field, reuse_addr=True).close()  # anyone on it: fails here
    return bind_tcp(host, port, field, reuse_port=True)


def threads_per_process(processes: int, torch_threads: int) -> int:
    """Intra-op threads each process uses: as configured, else the cores shared out."""
    if torch_threads:
        return torch_threads
    return max(1, len(os.sched_getaffinity(0)) // processes)


class ProcessGroup:
    """The parent of ``config.processes`` serving processes (see the module docstring)::

    group = ProcessGroup(config)
    line = group.start()      # every process ready; the ready line
    ...
    clean = group.stop()      # drain all
    """

    def __init__(self, config: ServeConfig):
        config.validate()
        self.config = config
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._members: list[_Member] = []
        self._reserved: list[socket.socket] = []
        self._child_config = config
        self._stopping = threading.Event()
        self._deaths: deque[float] = deque()
        self.failed = False
        """True once the group gave up restarting (a crash loop)."""
        self.registry = CollectorRegistry()
        self.restarts = Counter(
            "recserve_process_restarts",
            "Serving processes of the group restarted after dying",
            registry=self.registry,
        )
        self._metrics_server: Any = None
        self._supervisor: threading.Thread | None = None

    # ---- start --------------------------------------------------------------------------------
    def start(self) -> ReadyLine:
        """Reserves the ports, starts every process, waits until each is ready; returns the
        ready line. Raises ``OSError`` (a port) or :class:`GroupStartError` (a process)."""
        cfg = self.config
        grpc_port = self._reserve(cfg.host, cfg.grpc_port, "grpc_port")
        http_port = None
        if cfg.http_port is not None:
            http_port = self._reserve(cfg.host, cfg.http_port, "http_port")
        self._configure(grpc_port, http_port)
        try:
            self._members = [self._spawn(i) for i in self._indices()]
            for m in self._members:
                self._await_ready(m)
        except BaseException:
            self.stop()
            raise
        metrics = None
        if cfg.metrics_port is not None:
            metrics = self._serve_metrics(cfg.host, cfg.metrics_port)
        self._supervisor = threading.Thread(target=self._supervise, name="group", daemon=True)
        self._supervisor.start()
        return self._announce(metrics)

    def _configure(self, grpc_port: int, http_port: int | None) -> None:
        """The members' configs, once the ports are reserved."""
        cfg = self.config
        self._child_config = cfg.model_copy(
            update={
                "processes": 1,
                "grpc_port": grpc_port,
                "http_port": http_port,
                "metrics_port": None if cfg.metrics_port is None else 0,
                "torch_threads": threads_per_process(cfg.processes, cfg.torch_threads),
            }
        )

    def _indices(self) -> list[int]:
        """The members' slots, in the order they start."""
        return list(range(self.config.processes))

    def _reserve(self, host: str, port: int, field: str) -> int:
        sock = reserve_port(host, port, field)
        self._reserved.append(sock)
        return int(sock.getsockname()[1])

    def _target(self, index: int) -> tuple[Callable[..., None], tuple[Any, ...], str]:
        """What process ``index`` runs: ``(function, its arguments before the pipe, name)``."""
        return run_member, (self._child_config, index), f"serve-{index}"

    def _spawn(self, index: int) -> _Member:
        parent_end, child_end = self._ctx.Pipe()
        target, args, name = self._target(index)
        process = self._ctx.Process(target=target, args=(*args, child_end), name=name, daemon=False)
        process.start()
        child_end.close()  # the parent's copy: EOF on parent_end once the child is gone
        log.info("process %s (pid %d) started", self.label(index), process.pid)
        return _Member(index, process, parent_end)

    def _await_ready(self, m: _Member) -> None:
        """Blocks until ``m`` reports; :class:`GroupStartError` when it fails or dies first, or
        waits on a member that died (:meth:`_blocked`; it is picked up once ready)."""
        name = self.label(m.index)
        while True:
            if self._stopping.is_set() and self._supervisor is not None:
                raise GroupStartError(f"serving process {name}: the group is stopping")
            if m.conn.poll(0.2):
                self._take_report(m)
                return
            if not m.process.is_alive():
                raise GroupStartError(
                    f"serving process {name} exited ({m.process.exitcode}) before it was "
                    "ready (see its log)"
                )
            if self._supervisor is not None and self._blocked(m):
                raise GroupStartError(f"serving process {name}: waits for a process that died")

    def _take_report(self, m: _Member) -> None:
        """Reads ``m``'s report: ready, or :class:`GroupStartError` saying why not."""
        try:
            kind, payload = m.conn.recv()
        except EOFError:
            kind, payload = "failed", "it exited without saying why (see its log)"
        if kind == "ready":
            m.ready = payload
            log.info("process %s (pid %d) ready", self.label(m.index), m.process.pid)
            return
        m.process.join(10)
        raise GroupStartError(f"serving process {self.label(m.index)}: {payload}")

    def _blocked(self, m: _Member) -> bool:
        """Whether ``m`` cannot become ready until another member is restarted."""
        return False

    def _serve_metrics(self, host: str, port: int) -> str:
        self.registry.register(ProcessMetrics(self._metrics_addresses))
        try:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"metrics_port: cannot bind {host}:{port}: {e}") from None
        self._metrics_server = server
        return format_address(host, server.server_port)

    def _metrics_addresses(self) -> dict[str, str]:
        return {
            self.label(m.index): m.ready["metrics"]
            for m in list(self._members)
            if m.ready is not None and m.ready.get("metrics") and m.process.is_alive()
        }

    @staticmethod
    def label(index: int) -> str:
        """Process ``index``'s ``process`` label in ``/metrics``."""
        return str(index)

    def _announce(self, metrics: str | None) -> ReadyLine:
        """The group's ready line (its members' role and addresses, ``processes`` N); the same
        facts go to the log as a sentence."""
        first = self._members[-1].ready  # a process that serves the ports
        assert first is not None
        addresses = Addresses(first["grpc"], first["http"], metrics)
        serving = sum(1 for m in self._members if m.index >= 0)
        facts = (first["model"], first["version"], addresses, first["secured"], serving)
        log.info("%s", announce_line(*facts))
        return serving_ready(first["router"], *facts)

    # ---- supervise ----------------------------------------------------------------------------
    def _supervise(self) -> None:
        """Restarts a process that died, until :meth:`stop` or a crash loop."""
        while not self._stopping.wait(0.2):
            for slot, m in enumerate(list(self._members)):
                if m.ready is None and m.process.is_alive() and m.conn.poll(0):
                    with contextlib.suppress(GroupStartError):  # a late report (_blocked)
                        self._take_report(m)
                if m.process.is_alive() or self._stopping.is_set():
                    continue
                log.error(
                    "serving process %s (pid %d) died (exit %s); restarting it",
                    self.label(m.index),
                    m.process.pid,
                    m.process.exitcode,
                )
                now = time.monotonic()
                self._deaths.append(now)
                while self._deaths and self._deaths[0] < now - 60:
                    self._deaths.popleft()
                if len(self._deaths) > RESTARTS_PER_MINUTE:
                    log.critical("%d deaths within a minute: giving up", len(self._deaths))
                    self.failed = True
                    os.kill(os.getpid(), signal.SIGTERM)  # serve_processes drains the rest
                    return
                m.conn.close()
                fresh = self._spawn(m.index)
                self._members[slot] = fresh
                try:
                    self._await_ready(fresh)
                    self.restarts.inc()
                except GroupStartError as e:
                    log.error("%s", e)  # dead again: the next round counts it

    # ---- stop ---------------------------------------------------------------------------------
    def stop(self) -> bool:
        """SIGTERM to every process (each drains), waits ``drain_timeout_s`` plus a margin,
        kills what is left. True when every process drained and exited 0."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(self.config.drain_timeout_s)
        clean = True
        for wave in self._stop_waves():
            clean = self._stop_wave(wave) and clean
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        for sock in self._reserved:
            sock.close()
        self._reserved.clear()
        return clean and not self.failed

    def _stop_waves(self) -> list[list[_Member]]:
        """The members in the order they drain: each wave after the one before has exited."""
        return [list(self._members)]

    def _stop_wave(self, members: list[_Member]) -> bool:
        for m in members:
            if m.process.is_alive() and m.process.pid is not None:
                os.kill(m.process.pid, signal.SIGTERM)
        until = time.monotonic() + self.config.drain_timeout_s + 5.0
        clean = True
        for m in members:
            m.process.join(max(until - time.monotonic(), 0.0))
            if m.process.is_alive():
                log.error("serving process %s did not drain in time: killed", self.label(m.index))
                m.process.kill()
                m.process.join(5)
                clean = False
            elif m.process.exitcode not in (0, None):
                clean = False
            m.conn.close()
        return clean


def run_member(config: ServeConfig, index: int, conn: Connection) -> None:
    """A group process: one :class:`~serving.app.server.Server` until SIGTERM or the parent's end;
    reports ``("ready", {...})`` or ``("failed", message)`` on ``conn``."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s [process {index}] %(name)s: %(message)s",
    )
    exit_on_signals(signal.SIGTERM)  # while starting (a kernel build: a minute) nothing to drain
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the parent decides

    try:
        server = Server(config, reuse_port=True)
        a = server.start()
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        sys.exit(2)
    stop = StopSignals(signal.SIGTERM)  # serving: SIGTERM drains
    info = server.engine.info()
    conn.send(("ready", ready_facts(info.name, info.version, a, server.security.describe(),
                                    config.router is not None)))  # fmt: skip
    serve_until_stopped(conn, stop)
    clean = server.drain_and_stop()
    sys.stderr.flush()
    os._exit(0 if clean else 1)


def ready_facts(
    model: str, version: int, a: Addresses, secured: str, router: bool = False
) -> dict[str, Any]:
    """What a member reports once ready (the parent's ready line is made of them)."""
    return {"model": model, "version": version, "grpc": a.grpc, "http": a.http,
            "metrics": a.metrics, "secured": secured, "router": router}  # fmt: skip


def serve_until_stopped(conn: Connection, stop: StopSignals) -> None:
    """Blocks until ``stop`` (SIGTERM) or the parent's end (its pipe closes: it died)."""
    gone = threading.Event()

    def parent_gone() -> None:
        with contextlib.suppress(EOFError, OSError):
            conn.recv()  # the parent never sends: this ends (EOFError) when it is gone
        if not stop.received:
            log.error("the parent process is gone: draining")
            gone.set()

    threading.Thread(target=parent_gone, name="parent-watch", daemon=True).start()
    stop.wait(also=gone)


def serve_processes(config: ServeConfig) -> None:
    """:func:`serving.app.main.serve` for ``processes > 1``: the group until SIGTERM or SIGINT,
    then every process drains; status 1 when one did not drain or the group gave up."""
    group = ProcessGroup(config)
    serve_until_signal(group.start)
    log.info("draining %d processes (up to %.1f s)", config.processes, config.drain_timeout_s)
    if not group.stop():
        sys.stderr.flush()
        os._exit(1)
    log.info("drained; bye")
