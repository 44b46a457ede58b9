"""A local cluster on 127.0.0.1: embedding servers, shard servers and a router as real processes.

``recserve cluster up`` starts them in dependency order (embedding servers and shards first, the
router last, since it checks the shards' versions when it loads), each in its own session with
its output in a log file, on free ports; it waits until each prints its ready line (printed only
once the process serves and reports SERVING), then writes the cluster file. ``status`` checks
every process (alive, gRPC health), ``down`` stops them: SIGTERM (each drains), then SIGKILL
for any still alive after the timeout, so nothing is left behind. A failed ``up`` stops what it
started. Commands that change the cluster file hold its lock and record a process before waiting
for it (``recserve/cluster_state.py``; ``docs/sharding.md``).

    spec = ClusterSpec(model_repo=Path("runs/demo/model_repo"), shards=2, embedding_servers=1)
    cluster = up(spec, Path("runs/cluster"))
    cluster.router.grpc     # "127.0.0.1:PORT": Recommend, KServe v2, health
    down(Path("runs/cluster"))

Every process binds 127.0.0.1 (none is given ``--host``). With ``auth_token_file`` every one of
them needs the token (the router sends it to the shards and embedding servers); with
``tls_cert``/``tls_key`` every one serves TLS with that certificate, and the router and
``status`` verify them with ``tls_ca`` (default: the certificate itself, as when self-signed).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import process
from common.grpc_util import ClientAuth, open_channel
from recserve.cluster_state import (
    CLUSTER_FILE,
    LOCK_TIMEOUT_S,
    Cluster,
    ClusterError,
    Proc,
    locked,
)
from retrieval.artifact import ShardMap
from serving.repository.repository import ARTIFACT_DIR, EMBEDDINGS_DIR, ModelRepository
from serving.sharding.config import RouterConfig

__all__ = [  # the cluster file's types live in recserve/cluster_state.py
    "CLUSTER_FILE",
    "Cluster",
    "ClusterError",
    "ClusterSpec",
    "DownReport",
    "Proc",
    "ProcState",
    "check_version",
    "down",
    "healthy",
    "restart",
    "status",
    "stop",
    "up",
]
PORT_FREE_S = 5.0
"""How long ``down`` waits for the ports of stopped processes to close (a router's serving
processes exit just after their leader)."""


@dataclass
class ClusterSpec:
    model_repo: Path
    model: str = ""
    shards: int = 2
    replicas: int = 1
    embedding_servers: int = 1
    shard_deadline_ms: float = RouterConfig.model_fields["shard_deadline_ms"].default
    """The router's deadline per shard call; default: ``RouterConfig``'s (one default)."""
    hedge_after_ms: float = RouterConfig.model_fields["hedge_after_ms"].default
    router_grpc_port: int = 0
    router_http_port: int = 0
    router_processes: int = 1
    """Serving processes of the router (``recserve serve router --processes``)."""
    startup_timeout_s: float = 120.0
    auth_token_file: Path | None = None
    """Every process needs this bearer token (``common/security.py``); None: no token."""
    tls_cert: Path | None = None
    """Every process serves TLS with this certificate (and ``tls_key``); None: plaintext."""
    tls_key: Path | None = None
    tls_ca: Path | None = None
    """CA that verifies ``tls_cert`` (the router's ``--upstream-ca``); None: ``tls_cert``."""

    def security_args(self) -> list[str]:
        """The security flags every process of the cluster gets (paths: no secret in argv)."""
        args = []
        if self.auth_token_file is not None:
            args += ["--auth-token-file", str(self.auth_token_file.resolve())]
        if self.tls_cert is not None and self.tls_key is not None:
            args += ["--tls-cert", str(self.tls_cert.resolve())]
            args += ["--tls-key", str(self.tls_key.resolve())]
        return args

    def ca(self) -> Path | None:
        """The CA the router and ``status`` verify the processes with (None: plaintext)."""
        if self.tls_cert is None:
            return None
        return (self.tls_ca or self.tls_cert).resolve()


# ---- up -------------------------------------------------------------------------------------
def _recserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "recserve", *args]


def check_version(spec: ClusterSpec) -> tuple[str, int]:
    """The model and latest version to serve; refuses one whose shard layout or remote tables
    do not match the spec (naming the flag and how to fix it)."""
    repo = ModelRepository(spec.model_repo)
    models = repo.models()
    model = spec.model or (models[0] if len(models) == 1 else "")
    if model not in models:
        raise ClusterError(f"--model: name one of {models} in {spec.model_repo}")
    vdir = repo.verified_dir(model)
    smap = ShardMap.read(vdir / ARTIFACT_DIR)
    if smap is None or smap.num_shards != spec.shards:
        have = "is not document-sharded" if smap is None else f"has {smap.num_shards} shards"
        raise ClusterError(
            f"--shards {spec.shards}: {model} version {vdir.name} {have}; publish it with "
            f"shards={spec.shards} (ModelRepository.publish) or pass the version's shard count"
        )
    servers = sorted(
        int(p.name.split("-")[1]) for p in (vdir / EMBEDDINGS_DIR).glob("server-*") if p.is_dir()
    )
    if servers != list(range(spec.embedding_servers)):
        raise ClusterError(
            f"--embedding-servers {spec.embedding_servers}: {model} version {vdir.name} has rows "
            f"for {len(servers)} embedding servers"
        )
    return model, int(vdir.name)


def up(
    spec: ClusterSpec,
    directory: Path,
    progress: Callable[[str], None] | None = None,
    lock_timeout: float = LOCK_TIMEOUT_S,
) -> Cluster:
    """Starts the cluster (see the module docstring); raises :class:`ClusterError`. Holds the
    cluster's lock throughout, and records each process in the cluster file as soon as it is
    started: ``down`` stops those of an ``up`` that was killed."""
    if spec.shards < 1 or spec.replicas < 1 or spec.embedding_servers < 0:
        raise ClusterError("--shards and --replicas must be >= 1, --embedding-servers >= 0")
    if (spec.tls_cert is None) != (spec.tls_key is None):
        raise ClusterError("--tls-cert and --tls-key: give both, or neither")
    model, version = check_version(spec)
    with locked(directory, "up", lock_timeout):
        return _up(spec, directory, model, version, progress or (lambda _m: None))


def _up(
    spec: ClusterSpec, directory: Path, model: str, version: int, say: Callable[[str], None]
) -> Cluster:
    if (directory / CLUSTER_FILE).exists():
        previous = Cluster.load(directory)
        if any(p.alive() for p in previous.tracked()):
            raise ClusterError(f"a cluster is already up ({directory}); `recserve cluster down`")
    secure, ca = spec.security_args(), spec.ca()
    logs = directory / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log"):  # a new cluster starts with new logs
        old.unlink()
    repo = str(spec.model_repo)
    # processes that compute share the cores instead of each taking all of them
    threads = str(max(1, (os.cpu_count() or 1) // (spec.shards * spec.replicas + 1)))
    cluster = Cluster(model, version, tls_ca=str(ca or ""))
    try:
        started = [
            _start(
                f"embed-{i}",
                "embedding-server",
                _recserve(
                    "serve",
                    "embeddings",
                    "--model-repo",
                    repo,
                    "--model",
                    model,
                    "--index",
                    str(i),
                    "--grpc-port",
                    "0",
                    *secure,
                ),
                logs,
            )
            for i in range(spec.embedding_servers)
        ]
        started += [
            _start(
                f"shard-{s}-{r}",
                "shard",
                _recserve(
                    "serve",
                    "shard",
                    "--model-repo",
                    repo,
                    "--model",
                    model,
                    "--shard",
                    str(s),
                    "--grpc-port",
                    "0",
                    "--metrics-port",
                    "0",
                    "--torch-threads",
                    threads,
                    *secure,
                ),
                logs,
            )
            for s in range(spec.shards)
            for r in range(spec.replicas)
        ]
        cluster.processes = started
        cluster.save(directory)
        for p in started:
            _wait_ready(p, spec.startup_timeout_s)
            say(f"{p.name} ready at {p.address}")
        shards = ",".join(
            "|".join(p.address for p in started if p.name.startswith(f"shard-{s}-"))
            for s in range(spec.shards)
        )
        args = [
            "serve", "router", "--model-repo", repo, "--model", model,
            "--grpc-port", str(spec.router_grpc_port), "--http-port", str(spec.router_http_port),
            "--metrics-port", "0", "--shards", shards,
            "--shard-deadline-ms", str(spec.shard_deadline_ms),
            "--hedge-after-ms", str(spec.hedge_after_ms), "--torch-threads", threads, *secure,
        ]  # fmt: skip
        if spec.router_processes > 1:
            args += ["--processes", str(spec.router_processes)]
        if ca is not None:
            args += ["--upstream-ca", str(ca)]
        embed = [p.address for p in started if p.role == "embedding-server"]
        if embed:
            args += ["--embedding-servers", ",".join(embed)]
        router = _start("router", "router", _recserve(*args), logs)
        cluster.processes.append(router)
        cluster.save(directory)
        _wait_ready(router, spec.startup_timeout_s)
        say(f"router ready at grpc={router.address} http={router.http}")
    except BaseException:
        _stop_all(cluster.processes, timeout=10.0)
        (directory / CLUSTER_FILE).unlink(missing_ok=True)
        raise
    cluster.save(directory)
    return cluster


def _start(name: str, role: str, cmd: list[str], logs: Path) -> Proc:
    """Starts one process (``common/process.py``), its output appended to its log (a restart
    appends); in its own session: it outlives ``cluster up``, a Ctrl-C there does not reach it."""
    started = process.start(cmd, log_path=logs / f"{name}.log", new_session=True, name=name)
    return Proc(
        name,
        role,
        cmd,
        started.pid,
        str(started.log_path),
        log_offset=started.log_offset,
        started_at=started.started_at,
    )


def _wait_ready(p: Proc, timeout: float) -> None:
    """Waits for the process's ready line (``common/ready.py``); fills in its addresses."""
    try:
        ready = p.handle().wait_ready(timeout)
    except process.ProcessError as e:
        raise ClusterError(str(e)) from None
    p.address, p.http, p.metrics = ready.grpc or "", ready.http or "", ready.metrics or ""
    _fix_port(p)


def _fix_port(p: Proc) -> None:
    """Records the bound port in the command line, so a restart comes back on the same one."""
    port = p.address.rsplit(":", 1)[1]
    flag = "--grpc-port"  # every server's
    if flag in p.cmd:
        p.cmd[p.cmd.index(flag) + 1] = port


# ---- status, restart, down ------------------------------------------------------------------
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
            fresh = _start(old.name, old.role, old.cmd, Path(old.log).parent)
            fresh.address, fresh.http, fresh.metrics = old.address, old.http, old.metrics
            cluster.replace(old, fresh)
            try:
                cluster.save(directory)
            except BaseException:
                _stop_all([fresh], timeout=10.0)
                raise
        else:
            fresh = old  # alive: running, or being started by another restart
    try:
        _wait_ready(fresh, timeout)
    except BaseException:
        if ours:
            _stop_all([fresh], timeout=10.0)
        raise
    if ours:  # the ready line's ports (the router's HTTP and metrics ports are new ones)
        with locked(directory, f"restart {name}", lock_timeout):
            try:
                cluster = Cluster.load(directory)
                current = cluster.find(name)
            except ClusterError:
                current = None
            if current is None or current.pid != fresh.pid:
                _stop_all([fresh], timeout=10.0)
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
        return bool(_stop_all([Cluster.load(directory).find(name)], timeout))


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
        report.killed = _stop_all(order, timeout)
        report.stopped = [(p.name, p.pid) for p in order]
        addresses = {a for p in tracked for a in (p.address, p.http, p.metrics) if a}
        report.busy = _still_answering(sorted(addresses), PORT_FREE_S)
        if not report.busy:
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


def _stop_all(procs: list[Proc], timeout: float) -> list[str]:
    """SIGTERM each process group, wait up to ``timeout`` s, SIGKILL the rest (together, via
    ``common/process.py``); the names of those that needed SIGKILL."""
    return [h.name for h in process.stop_all([p.handle() for p in procs], timeout)]
