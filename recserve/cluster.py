"""A local cluster on 127.0.0.1: embedding servers, shard servers and a router as real processes.

``recserve cluster up`` starts them in dependency order (embedding servers and shards first, the
router last, since it checks the shards' versions when it loads), each in its own session with
its output in a log file, on free ports; it waits until each prints its ready line (printed only
once the process serves and reports SERVING), then writes the cluster file. ``status`` checks
every process (alive, gRPC health), ``down`` stops them: SIGTERM (each drains), then SIGKILL
for any still alive after the timeout, so nothing is left behind. A failed ``up`` stops what it
started.

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

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import process
from common.atomic import atomic_write_json
from common.grpc_util import ClientAuth, open_channel
from retrieval.artifact import ShardMap
from serving.repository.repository import ARTIFACT_DIR, EMBEDDINGS_DIR, ModelRepository
from serving.sharding.config import RouterConfig

CLUSTER_FILE = "cluster.json"
MARKER = "recserve"
"""In the command line of every process of a cluster: a recorded pid whose command line lacks
it was given to another program since, and is never signalled."""


class ClusterError(RuntimeError):
    """The cluster cannot start (the message says which process and why, with its log tail)."""


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


@dataclass
class Proc:
    """One process of the cluster, as the cluster file records it."""

    name: str
    role: str
    cmd: list[str]
    pid: int
    log: str
    address: str = ""
    """gRPC ``host:port``."""
    http: str = ""
    metrics: str = ""
    log_offset: int = 0
    """Where this run of the process starts in its log (earlier runs' lines come before)."""


@dataclass
class Cluster:
    model: str
    version: int
    processes: list[Proc] = field(default_factory=list)
    tls_ca: str = ""
    """CA of the processes' TLS certificate ("": they serve plaintext)."""

    @property
    def router(self) -> Proc:
        return next(p for p in self.processes if p.role == "router")

    def save(self, directory: Path) -> Path:
        path = directory / CLUSTER_FILE
        atomic_write_json(path, asdict(self))
        return path

    @classmethod
    def load(cls, directory: Path) -> Cluster:
        path = directory / CLUSTER_FILE
        if not path.is_file():
            raise ClusterError(
                f"no cluster file at {path} (is a cluster up? `recserve cluster up`)"
            )
        d = json.loads(path.read_text())
        procs = [Proc(**p) for p in d["processes"]]
        return cls(d["model"], d["version"], procs, d.get("tls_ca", ""))


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
    spec: ClusterSpec, directory: Path, progress: Callable[[str], None] | None = None
) -> Cluster:
    """Starts the cluster (see the module docstring); raises :class:`ClusterError`."""
    say = progress or (lambda _m: None)
    if (directory / CLUSTER_FILE).exists():
        cluster = Cluster.load(directory)
        if any(_alive(p) for p in cluster.processes):
            raise ClusterError(f"a cluster is already up ({directory}); `recserve cluster down`")
    if spec.shards < 1 or spec.replicas < 1 or spec.embedding_servers < 0:
        raise ClusterError("--shards and --replicas must be >= 1, --embedding-servers >= 0")
    if (spec.tls_cert is None) != (spec.tls_key is None):
        raise ClusterError("--tls-cert and --tls-key: give both, or neither")
    secure = spec.security_args()
    ca = spec.ca()
    model, version = check_version(spec)
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
        _wait_ready(router, spec.startup_timeout_s)
        say(f"router ready at grpc={router.address} http={router.http}")
    except BaseException:
        _stop_all(cluster.processes, timeout=10.0)
        raise
    cluster.save(directory)
    return cluster


def _start(name: str, role: str, cmd: list[str], logs: Path) -> Proc:
    """Starts one process (``common/process.py``), its output appended to its log (a restart
    appends); in its own session: it outlives ``cluster up``, a Ctrl-C there does not reach it."""
    started = process.start(cmd, log_path=logs / f"{name}.log", new_session=True, name=name)
    return Proc(name, role, cmd, started.pid, str(started.log_path), log_offset=started.log_offset)


def _handle(p: Proc) -> process.Proc:
    """The launcher's handle on a recorded process (this run may not be the one that started
    it: ``down`` is another command)."""
    return process.Proc.adopt(
        p.pid, p.cmd, Path(p.log), marker=MARKER, log_offset=p.log_offset, name=p.name
    )


def _wait_ready(p: Proc, timeout: float) -> None:
    """Waits for the process's ready line (``common/ready.py``); fills in its addresses."""
    try:
        ready = _handle(p).wait_ready(timeout)
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
def _alive(p: Proc) -> bool:
    """The process exists, is not a zombie, and is ours (see :data:`MARKER`)."""
    return _handle(p).alive()


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


def status(directory: Path) -> list[tuple[Proc, bool, bool]]:
    """``(process, alive, healthy)`` of every process of the cluster."""
    cluster = Cluster.load(directory)
    out = []
    for p in cluster.processes:
        alive = _alive(p)
        ok = alive and bool(p.address) and healthy(p.address, tls_ca=cluster.tls_ca)
        out.append((p, alive, ok))
    return out


def restart(directory: Path, name: str, timeout: float = 60.0) -> Proc:
    """Starts process ``name`` again with its recorded command (same port) if it is not alive."""
    cluster = Cluster.load(directory)
    found = [p for p in cluster.processes if p.name == name]
    if not found:
        raise ClusterError(f"no process {name!r} (have: {[p.name for p in cluster.processes]})")
    old = found[0]
    if _alive(old):
        return old
    fresh = _start(old.name, old.role, old.cmd, Path(old.log).parent)
    _wait_ready(fresh, timeout)
    cluster.processes[cluster.processes.index(old)] = fresh
    cluster.save(directory)
    return fresh


def stop(directory: Path, name: str, timeout: float = 15.0) -> bool:
    """Stops process ``name`` (SIGTERM: it drains; SIGKILL after ``timeout`` s); returns True
    when it needed SIGKILL. :func:`restart` starts it again."""
    found = [p for p in Cluster.load(directory).processes if p.name == name]
    if not found:
        raise ClusterError(f"no process {name!r}")
    return bool(_stop_all(found, timeout))


def down(directory: Path, timeout: float = 15.0) -> list[str]:
    """Stops every process (router first); returns the names that needed SIGKILL."""
    cluster = Cluster.load(directory)
    order = sorted(cluster.processes, key=lambda p: p.role != "router")
    killed = _stop_all(order, timeout)
    (directory / CLUSTER_FILE).unlink(missing_ok=True)
    return killed


def _stop_all(procs: list[Proc], timeout: float) -> list[str]:
    """SIGTERM each process group, wait up to ``timeout`` s, SIGKILL the rest (together, via
    ``common/process.py``); the names of those that needed SIGKILL."""
    return [h.name for h in process.stop_all([_handle(p) for p in procs], timeout)]
