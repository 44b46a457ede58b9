"""The lifecycle commands of a local cluster once ``up`` (``recserve/cluster.py``) started it:
``status`` checks every process (alive, gRPC health), ``restart`` starts one again on its port,
``stop`` stops one, ``down`` stops them all: SIGTERM (each drains), then SIGKILL for any still
alive after the timeout, so nothing is left behind. Commands that change the cluster file hold
its lock (``recserve/cluster_state.py``)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_util import ClientAuth, open_channel
from recserve.cluster_hosts import remove_hosts
from recserve.cluster_procs import start_proc, stop_procs, wait_ready
from recserve.cluster_state import CLUSTER_FILE, LOCK_TIMEOUT_S, Cluster, ClusterError, Proc, locked

PORT_FREE_S = 5.0
"""How long ``down`` waits for the ports of stopped processes to close (a router's serving
processes exit just after their leader)."""


def healthy(address: str, timeout: float = 2.0, tls_ca: str = "") -> bool:
    """grpc.health.v1 says SERVING at ``address`` (over TLS verified by ``tls_ca`` when set;
    health checks need no token)."""
    auth = ClientAuth(Path(tls_ca).read_bytes()) if tls_ca else None
    with open_channel(address, (), auth) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class ProcState(NamedTuple):
    """One row of :func:`status`."""

    proc: Proc
    alive: bool
    healthy: bool
    """Alive and gRPC health says SERVING at its address."""
    note: str
    """``serving``, ``not serving``, ``down``, or ``down, port answered by another process``."""


def status(directory: Path) -> list[ProcState]:
    """Every process of the cluster; a dead pid is reported down (no lock: reads change
    nothing, and the file is replaced atomically)."""
    cluster = Cluster.load(directory)
    out = []
    for p in cluster.processes:
        alive = p.alive()
        answers = bool(p.address) and healthy(p.address, tls_ca=cluster.tls_ca)
        if alive:
            note = "serving" if answers else "not serving"
        else:
            note = "down, port answered by another process" if answers else "down"
        out.append(ProcState(p, alive, alive and answers, note))
    return out


def restart(
    directory: Path, name: str, timeout: float = 60.0, lock_timeout: float = LOCK_TIMEOUT_S
) -> Proc:
    """Starts process ``name`` again with its recorded command (same port) if it is not alive,
    and waits until it is ready.

    The new process is recorded (under the lock) before the wait, which runs without the lock:
    a ``down`` meanwhile stops it, and a concurrent restart of the same name finds it alive and
    waits for it instead of starting a second one. If it is not ready within ``timeout`` s (or
    exits, or this call is interrupted), it is stopped, so a failed restart leaves nothing
    running; its entry stays (``status``: down) for the next restart."""
    with locked(directory, f"restart {name}", lock_timeout):
        cluster = Cluster.load(directory)
        old = cluster.find(name)
        ours = not old.alive()
        if ours:
            fresh = start_proc(old.name, old.role, old.cmd, Path(old.log).parent)
            fresh.address, fresh.http, fresh.metrics = old.address, old.http, old.metrics
            cluster.replace(old, fresh)
            try:
                cluster.save(directory)
            except BaseException:
                stop_procs([fresh], timeout=10.0)
                raise
        else:
            fresh = old  # alive: running, or being started by another restart
    try:
        wait_ready(fresh, timeout)
    except BaseException:
        if ours:
            stop_procs([fresh], timeout=10.0)
        raise
    if ours:  # the ready line's ports (the router's HTTP and metrics ports are new ones)
        with locked(directory, f"restart {name}", lock_timeout):
            try:
                cluster = Cluster.load(directory)
                current = cluster.find(name)
            except ClusterError:
                current = None
            if current is None or current.pid != fresh.pid:
                stop_procs([fresh], timeout=10.0)
                raise ClusterError(f"{name}: the cluster went down while it restarted")
            current.address, current.http, current.metrics = (
                fresh.address,
                fresh.http,
                fresh.metrics,
            )
            cluster.save(directory)
    return fresh


def stop(
    directory: Path, name: str, timeout: float = 15.0, lock_timeout: float = LOCK_TIMEOUT_S
) -> bool:
    """Stops process ``name`` (SIGTERM: it drains; SIGKILL after ``timeout`` s); returns True
    when it needed SIGKILL. :func:`restart` starts it again."""
    with locked(directory, f"stop {name}", lock_timeout):
        return bool(stop_procs([Cluster.load(directory).find(name)], timeout))


@dataclass
class DownReport:
    """What :func:`down` did; ``(name, pid)`` pairs."""

    stopped: list[tuple[str, int]] = field(default_factory=list)
    gone: list[tuple[str, int]] = field(default_factory=list)
    """Recorded, but found already gone (or the pid is now another program's: not signalled)."""
    killed: list[str] = field(default_factory=list)
    """Names that needed SIGKILL."""
    busy: list[str] = field(default_factory=list)
    """Addresses of the cluster that still accept connections after the stop: a process the
    cluster file does not track holds them."""


def down(
    directory: Path, timeout: float = 15.0, lock_timeout: float = LOCK_TIMEOUT_S
) -> DownReport:
    """Stops every process the cluster file tracks, current and retired (router first), under
    the lock; removes the file (kept when a port stays busy, to look at)."""
    with locked(directory, "down", lock_timeout):
        cluster = Cluster.load(directory)
        tracked = cluster.tracked()
        live = [p for p in tracked if p.alive()]
        report = DownReport(gone=[(p.name, p.pid) for p in tracked if p not in live])
        order = sorted(live, key=lambda p: p.role != "router")
        report.killed = stop_procs(order, timeout)
        report.stopped = [(p.name, p.pid) for p in order]
        addresses = {a for p in tracked for a in (p.address, p.http, p.metrics) if a}
        report.busy = _still_answering(sorted(addresses), PORT_FREE_S)
        if not report.busy:
            remove_hosts(cluster)
            (directory / CLUSTER_FILE).unlink(missing_ok=True)
    return report


def _still_answering(addresses: list[str], timeout: float) -> list[str]:
    """Those of ``addresses`` that still accept a TCP connection after ``timeout`` s."""
    until = time.monotonic() + timeout
    while True:
        busy = [a for a in addresses if _accepts(a)]
        if not busy or time.monotonic() >= until:
            return busy
        time.sleep(0.1)


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False
