"""``recserve cluster up / status / restart / net / link / down``: a local cluster on 127.0.0.1 or
on namespaced hosts (router, document shards, embedding servers as real processes;
``recserve/cluster.py`` and ``recserve/cluster_hosts.py`` do the work)."""

from __future__ import annotations

from pathlib import Path

import typer

from recserve.options import field_option
from serving.sharding.config import RouterConfig

cluster_app = typer.Typer(
    no_args_is_help=True,
    help="A local cluster on 127.0.0.1: router, document shards, embedding servers.",
)
CLUSTER_DIR = Path("runs/cluster")
"""Relative to the current directory, like every default path of the CLI."""
LOCK_HELP = "seconds to wait for another cluster command's lock on the cluster file"


@cluster_app.command("up")
def cluster_up(
    model_repo: Path = typer.Option(..., help="repository with a document-sharded version"),
    model: str = typer.Option("", help="model (default: the repository's only one)"),
    shards: int = typer.Option(2, min=1, help="document shards (the version's shard count)"),
    replicas: int = typer.Option(1, min=1, help="shard servers per shard"),
    embedding_servers: int = typer.Option(1, min=0, help="embedding servers (the version's)"),
    grpc_port: int = typer.Option(0, min=0, max=65535, help="router gRPC port (0: any free)"),
    http_port: int = typer.Option(0, min=0, max=65535, help="router HTTP port (0: any free)"),
    shard_deadline_ms: float = field_option(RouterConfig, "shard_deadline_ms"),
    hedge_after_ms: float = field_option(RouterConfig, "hedge_after_ms"),
    shard_threads: int = typer.Option(
        0,
        min=0,
        help="torch threads of each shard server (0: the cores shared out over the shard "
        "servers and the router); more where the index scan dominates (large catalogs)",
    ),
    batches_in_flight: int = typer.Option(
        1,
        min=1,
        help="router: batches routed at once (serve router --batches-in-flight); 1 here, where "
        "the shards share the router's cores",
    ),
    router_processes: int = typer.Option(
        1, min=1, help="router: serving processes sharing its ports (serve router --processes)"
    ),
    state_dir: Path = typer.Option(
        None, help="router: live updates on, their log in this folder (serve router --state-dir)"
    ),
    directory: Path = typer.Option(CLUSTER_DIR, help="cluster file and logs"),
    auth_token_file: Path = typer.Option(
        None, help="every process needs this bearer token (the router sends it on)"
    ),
    tls_cert: Path = typer.Option(None, help="every process serves TLS with this certificate"),
    tls_key: Path = typer.Option(None, help="PEM private key of --tls-cert"),
    tls_ca: Path = typer.Option(None, help="CA verifying --tls-cert (default: --tls-cert)"),
    hosts: str = typer.Option(
        "local",
        help="local: every process on 127.0.0.1; netns: each on a host (network namespace) of "
        "its own, reached at its address (needs root)",
    ),
    network: str = typer.Option(
        "none", help="with --hosts netns: the network profile (none, dc, zone, bad)"
    ),
    lock_timeout: float = typer.Option(30.0, min=0, help=LOCK_HELP),
) -> None:
    """Start embedding servers, shard servers and the router; wait until all are healthy."""
    from recserve.cluster import ClusterError, ClusterSpec, up

    spec = ClusterSpec(
        model_repo=model_repo,
        model=model,
        shards=shards,
        replicas=replicas,
        embedding_servers=embedding_servers,
        shard_deadline_ms=shard_deadline_ms,
        hedge_after_ms=hedge_after_ms,
        router_grpc_port=grpc_port,
        router_http_port=http_port,
        router_processes=router_processes,
        shard_threads=shard_threads,
        batches_in_flight=batches_in_flight,
        state_dir=state_dir,
        auth_token_file=auth_token_file,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_ca=tls_ca,
        hosts=hosts,
        network=network,
    )
    try:
        cluster = up(spec, directory, progress=typer.echo, lock_timeout=lock_timeout)
    except (ClusterError, OSError, ValueError) as e:
        typer.echo(f"cluster up: {e}", err=True)
        raise typer.Exit(2) from None
    r = cluster.router
    typer.echo(
        f"cluster up: {cluster.model} v{cluster.version}, {len(cluster.processes)} processes; "
        f"router grpc={r.reach} http={r.http} metrics={r.metrics} "
        f"(file: {directory / 'cluster.json'})"
    )


@cluster_app.command("status")
def cluster_status(
    directory: Path = typer.Option(CLUSTER_DIR, help="cluster file and logs"),
) -> None:
    """Every process: pid, address, alive, healthy (exit 1 when any is not; a dead pid is
    reported down)."""
    from rich.console import Console
    from rich.table import Table

    # not recserve.cluster: its `up` needs torch, which status does not
    from recserve.cluster_lifecycle import status
    from recserve.cluster_state import ClusterError

    try:
        rows = status(directory)
    except ClusterError as e:
        typer.echo(f"cluster status: {e}", err=True)
        raise typer.Exit(2) from None
    table = Table("process", "role", "pid", "address", "alive", "healthy", "state")
    for p, alive, ok, note in rows:
        table.add_row(p.name, p.role, str(p.pid), p.address, str(alive), str(ok), note)
    Console().print(table)
    if not all(row.healthy for row in rows):
        raise typer.Exit(1)


@cluster_app.command("restart")
def cluster_restart(
    name: str = typer.Argument(..., help="process name, e.g. shard-1-0"),
    directory: Path = typer.Option(CLUSTER_DIR, help="cluster file and logs"),
    timeout: float = typer.Option(
        60.0, min=0, help="seconds to wait for it to be ready; then it is stopped again"
    ),
    lock_timeout: float = typer.Option(30.0, min=0, help=LOCK_HELP),
) -> None:
    """Start a stopped process again, on its old port, and wait until it is ready (a running
    one, or one another restart is starting, is waited for, not started twice)."""
    # not recserve.cluster: its `up` needs torch, which restart does not
    from recserve.cluster_lifecycle import restart
    from recserve.cluster_state import ClusterError

    try:
        p = restart(directory, name, timeout, lock_timeout)
    except ClusterError as e:
        typer.echo(f"cluster restart: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{p.name} running (pid {p.pid}) at {p.address}")


@cluster_app.command("net")
def cluster_net(
    profile: str = typer.Argument(..., help="network profile: none, dc, zone, bad"),
    host: list[str] = typer.Option(None, help="only these hosts (default: all), e.g. shard-1-0"),
    directory: Path = typer.Option(CLUSTER_DIR, help="cluster file and logs"),
) -> None:
    """Change a running `--hosts netns --network ...` cluster's network profile (its relays
    apply it from the next bytes they read)."""
    from recserve.cluster import ClusterError
    from recserve.cluster_hosts import set_network
    from recserve.hosts.relay import profile_named

    try:
        set_network(directory, profile_named(profile), host or None)
    except (ClusterError, ValueError) as e:
        typer.echo(f"cluster net: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"network {profile} on {', '.join(host) if host else 'every host'}")


@cluster_app.command("link")
def cluster_link(
    host: str = typer.Argument(..., help="host, e.g. shard-1-0"),
    state: str = typer.Argument(..., help="down (a partition) or up"),
    directory: Path = typer.Option(CLUSTER_DIR, help="cluster file and logs"),
) -> None:
    """Take a `--hosts netns` cluster's host off the network (down) or back (up)."""
    from recserve.cluster import ClusterError
    from recserve.cluster_hosts import set_link

    if state not in ("up", "down"):
        typer.echo(f"cluster link: state is up or down, got {state!r}", err=True)
        raise typer.Exit(2)
    try:
        set_link(directory, host, state == "up")
    except ClusterError as e:
        typer.echo(f"cluster link: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{host}: link {state}")


@cluster_app.command("down")
def cluster_down(
    directory: Path = typer.Option(CLUSTER_DIR, help="cluster file and logs"),
    timeout: float = typer.Option(15.0, min=0, help="seconds to drain before SIGKILL"),
    lock_timeout: float = typer.Option(30.0, min=0, help=LOCK_HELP),
) -> None:
    """Stop every process the cluster file ever tracked: SIGTERM (drain), SIGKILL after
    --timeout; exit 1 if a port of the cluster still answers afterwards."""
    # not recserve.cluster: its `up` needs torch, which down does not
    from recserve.cluster_lifecycle import down
    from recserve.cluster_state import ClusterError

    try:
        report = down(directory, timeout, lock_timeout)
    except ClusterError as e:
        typer.echo(f"cluster down: {e}", err=True)
        raise typer.Exit(2) from None
    for name, pid in report.stopped:
        how = " (SIGKILL)" if name in report.killed else ""
        typer.echo(f"stopped {name} (pid {pid}){how}")
    for name, pid in report.gone:
        typer.echo(f"already gone: {name} (pid {pid})")
    if report.busy:
        typer.echo(
            f"cluster down: still answering at {', '.join(report.busy)}: a process the cluster "
            f"file does not track; {directory / 'cluster.json'} kept",
            err=True,
        )
        raise typer.Exit(1)
    typer.echo("cluster down")
