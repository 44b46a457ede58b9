"""``recserve test load | soak``: load against a running server, and a soak of a local cluster."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer

test_app = typer.Typer(
    no_args_is_help=True,
    help="Load tests: locust against a running server; a soak of a local cluster.",
)


class Protocol(StrEnum):
    """What the simulated users call."""

    grpc = "grpc"
    http = "http"


@test_app.command("load")
def test_load(
    target: str = typer.Option(..., help="HOST:PORT of the gRPC or HTTP listener"),
    protocol: Protocol = typer.Option(
        Protocol.grpc, help="grpc (Recommend) or http (KServe v2 infer)"
    ),
    model_repo: Path = typer.Option(..., help="model repository: shapes the requests"),
    model: str = typer.Option(None, help="model (default: the repository's only one)"),
    users: int = typer.Option(10, min=1, help="concurrent locust users"),
    spawn_rate: float = typer.Option(5.0, min=0.01, help="users started per second"),
    duration: float = typer.Option(30.0, min=1, help="seconds of load"),
    out: Path = typer.Option(Path("runs/loadtest"), help="CSVs, summary.json, latency.png"),
    max_p99_ms: float = typer.Option(None, min=0, help="fail (exit 1) when p99 is over this"),
    max_failure_ratio: float = typer.Option(
        None, min=0, max=1, help="fail (exit 1) when failures / requests is over this"
    ),
) -> None:
    """Load-test a running target with locust (loadtest/locustfile.py, headless); prints
    requests, RPS, p50/p95/p99 and failures, writes summary.json and latency.png; exit 1 when
    a threshold is missed, 2 when the target is down or locust fails."""
    from loadtest.shape import read_model_shape
    from recserve import loadtest as lt

    try:
        shape = read_model_shape(model_repo, model)
        lt.check_target(target, protocol.value)
        spec = lt.LoadTestSpec(
            target, protocol.value, model_repo, shape.name, users, spawn_rate, duration, out
        )
        summary, problems = lt.run(spec, lt.Thresholds(max_p99_ms, max_failure_ratio))
    except (ValueError, lt.TargetDownError, lt.LoadTestError) as e:
        typer.echo(f"loadtest: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(lt.format_summary(spec, summary))
    typer.echo(f"wrote {out / 'summary.json'} and {out / 'latency.png'}")
    for p in problems:
        typer.echo(f"loadtest: FAILED: {p}", err=True)
    if problems:
        raise typer.Exit(1)


@test_app.command("soak")
def test_soak(
    minutes: float = typer.Option(None, min=0.1, help="how long to load (default: --seconds)"),
    seconds: float = typer.Option(60.0, min=6, help="how long to load, in seconds"),
    qps: float = typer.Option(50.0, min=0.1, max=2000, help="open-loop request rate"),
    items: int = typer.Option(20_000, min=1000, help="catalog size of the synthetic model"),
    shards: int = typer.Option(2, min=1, help="document shards"),
    replicas: int = typer.Option(2, min=2, help="replicas per shard (one is restarted)"),
    max_p99_ms: float = typer.Option(250.0, min=0.1, help="fail when p99 is over this"),
    deadline_ms: float = typer.Option(2000.0, min=1, help="each call's gRPC deadline"),
    out: Path = typer.Option(Path("runs/soak"), help="work folders and soak.json"),
) -> None:
    """Soak a local cluster: steady open-loop load with a hot reload (v2 published at T/3) and
    a shard replica restart (T/2). Exit 1 when a call failed or was partial, p99 is over
    --max-p99-ms, the router never served v2, or its success counter differs from the client's
    OK count; 2 when the cluster cannot start."""
    from recserve import soak

    spec = soak.SoakSpec(
        seconds=minutes * 60 if minutes is not None else seconds, qps=qps, out=out,
        items=items, shards=shards, replicas=replicas, max_p99_ms=max_p99_ms,
        deadline_ms=deadline_ms,
    )  # fmt: skip
    try:
        report = soak.run(spec, say=typer.echo)
    except (ValueError, soak.local_cluster.ClusterError) as e:
        typer.echo(f"soak: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(soak.format_report(report))
    typer.echo(f"wrote {out / 'soak.json'}")
    for p in report["problems"]:
        typer.echo(f"soak: FAILED: {p}", err=True)
    if report["problems"]:
        raise typer.Exit(1)
