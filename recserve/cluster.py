"""A local cluster on 127.0.0.1: embedding servers, shard servers and a router as real processes.

``recserve cluster up`` starts them in dependency order (embedding servers and shards first, the
router last, since it checks the shards' versions when it loads), each in its own session with
its output in a log file, on free ports; it waits until each prints its ready line (printed only
once the process serves and reports SERVING), then writes the cluster file. A failed ``up`` stops
what it started. ``status``, ``restart``, ``stop`` and ``down`` (``recserve/cluster_lifecycle.py``,
exported here too) check, restart and stop the processes. Commands that change the cluster
file hold its lock and record a process before waiting for it (``recserve/cluster_state.py``;
``docs/sharding.md``).

    spec = ClusterSpec(model_repo=Path("runs/demo/model_repo"), shards=2, embedding_servers=1)
    cluster = up(spec, Path("runs/cluster"))
    cluster.router.grpc     # "127.0.0.1:PORT": Recommend, KServe v2, health
    down(Path("runs/cluster"))

Every process binds 127.0.0.1 (none is given ``--host``), or with ``hosts="netns"`` each runs on
a host of its own and binds its address (``recserve/cluster_hosts.py``). With
``auth_token_file`` every one of them needs the token (the router sends it to the shards and
embedding servers); with ``tls_cert``/``tls_key`` every one serves TLS with that certificate,
and the router and ``status`` verify them with ``tls_ca`` (default: the certificate itself, as
when self-signed).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from recserve.cluster_hosts import host_names, make_hosts, on_host, remove_hosts, start_relays
from recserve.cluster_lifecycle import (
    DownReport,
    ProcState,
    down,
    healthy,
    restart,
    status,
    stop,
)
from recserve.cluster_procs import start_proc, stop_procs, wait_ready
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

# the cluster file's types live in recserve/cluster_state.py, the lifecycle commands (status,
# restart, stop, down) in recserve/cluster_lifecycle.py: one import for callers
__all__ = [
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
    "thread_split",
    "up",
]


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
    shard_threads: int = 0
    """Torch threads of each shard server; 0: the cores shared out over the shard servers and
    the router, as the router gets (``thread_split``)."""
    batches_in_flight: int = 1
    """The router's batches at once (``serve router --batches-in-flight``): 1, since here the
    shards compute on the router's own cores (``RouterConfig.batches_in_flight``)."""
    state_dir: Path | None = None
    """The router's update log folder (``serve router --state-dir``): live updates through the
    router to every shard; None: off."""
    startup_timeout_s: float = 120.0
    auth_token_file: Path | None = None
    """Every process needs this bearer token (``common/security.py``); None: no token."""
    tls_cert: Path | None = None
    """Every process serves TLS with this certificate (and ``tls_key``); None: plaintext."""
    tls_key: Path | None = None
    tls_ca: Path | None = None
    """CA that verifies ``tls_cert`` (the router's ``--upstream-ca``); None: ``tls_cert``."""
    hosts: str = "local"
    """``local``: every process on 127.0.0.1; ``netns``: each on a host (network namespace) of
    its own, bound to its address (``recserve/cluster_hosts.py``)."""
    network: str = "none"
    """With ``netns``: the hosts' network profile (``none``, ``dc``, ``zone``, ``bad``:
    ``recserve/hosts/relay.py``), applied by a relay on each host."""

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
def thread_split(spec: ClusterSpec, cores: int) -> tuple[int, int]:
    """(the router's, each shard server's) torch threads on ``cores``: processes that compute
    share the cores instead of each taking all of them, so each gets ``cores // (shard servers
    + 1)``; ``spec.shard_threads`` overrides the shards' (a catalog whose scans dominate, where
    the router's tower and merge are small beside them)."""
    shared = max(1, cores // (spec.shards * spec.replicas + 1))
    return shared, spec.shard_threads or shared


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
    router_threads, shard_threads = (str(t) for t in thread_split(spec, os.cpu_count() or 1))
    names = host_names(spec.shards, spec.replicas, spec.embedding_servers)
    hosts = make_hosts(spec.hosts, spec.network, names)
    cluster = Cluster(model, version, tls_ca=str(ca or ""), network=spec.network)
    if hosts is not None:
        cluster.hosts = hosts.to_json()
    try:
        embed_cmd = [
            "serve", "embeddings", "--model-repo", repo, "--model", model, "--grpc-port", "0",
            *secure,
        ]  # fmt: skip
        started = [
            start_proc(
                f"embed-{i}",
                "embedding-server",
                on_host(hosts, f"embed-{i}", _recserve(*embed_cmd, "--index", str(i))),
                logs,
            )
            for i in range(spec.embedding_servers)
        ]
        shard_cmd = [
            "serve", "shard", "--model-repo", repo, "--model", model, "--grpc-port", "0",
            "--metrics-port", "0", "--torch-threads", shard_threads, *secure,
        ]  # fmt: skip
        started += [
            start_proc(
                f"shard-{s}-{r}",
                "shard",
                on_host(hosts, f"shard-{s}-{r}", _recserve(*shard_cmd, "--shard", str(s))),
                logs,
            )
            for s in range(spec.shards)
            for r in range(spec.replicas)
        ]
        cluster.processes = started
        cluster.save(directory)
        for p in started:
            wait_ready(p, spec.startup_timeout_s)
            say(f"{p.name} ready at {p.address}")
        if hosts is not None and spec.network != "none":
            cluster.processes += start_relays(
                hosts, started, spec.network, directory, spec.startup_timeout_s
            )
            cluster.save(directory)
        shards = ",".join(
            "|".join(p.reach for p in started if p.name.startswith(f"shard-{s}-"))
            for s in range(spec.shards)
        )
        args = [
            "serve", "router", "--model-repo", repo, "--model", model,
            "--grpc-port", str(spec.router_grpc_port), "--http-port", str(spec.router_http_port),
            "--metrics-port", "0", "--shards", shards,
            "--shard-deadline-ms", str(spec.shard_deadline_ms),
            "--hedge-after-ms", str(spec.hedge_after_ms), "--torch-threads", router_threads,
            "--batches-in-flight", str(spec.batches_in_flight), *secure,
        ]  # fmt: skip
        if spec.router_processes > 1:
            args += ["--processes", str(spec.router_processes)]
        if spec.state_dir is not None:
            args += ["--state-dir", str(spec.state_dir.resolve())]
        if ca is not None:
            args += ["--upstream-ca", str(ca)]
        embed = [p.reach for p in started if p.role == "embedding-server"]
        if embed:
            args += ["--embedding-servers", ",".join(embed)]
        router = start_proc("router", "router", on_host(hosts, "router", _recserve(*args)), logs)
        cluster.processes.append(router)
        cluster.save(directory)
        wait_ready(router, spec.startup_timeout_s)
        if hosts is not None and spec.network != "none":
            cluster.processes += start_relays(
                hosts, [router], spec.network, directory, spec.startup_timeout_s
            )
        say(f"router ready at grpc={router.reach} http={router.http}")
    except BaseException:
        stop_procs(cluster.processes, timeout=10.0)
        (directory / CLUSTER_FILE).unlink(missing_ok=True)
        remove_hosts(cluster)
        raise
    cluster.save(directory)
    return cluster
