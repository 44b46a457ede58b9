"""``recserve`` command line: one subcommand per job.

recserve demo              train on MovieLens 100k, build the index, print recommendations and recall
recserve train             train from a config (torchrun for several processes), evaluate, publish
recserve score             score a parquet file of users offline with a published model
recserve loadtest          locust (gRPC or HTTP users) against a server, with a summary and a plot
recserve fetch-movielens   extract MovieLens 100k from the recbole wheel into data/ml-100k
recserve bench-ann         the index benchmark (bench/ann.py) vs faiss
recserve embed-server      serve one shard of embedding rows (the remote tier) over gRPC
recserve serve             serve a model repository: gRPC Recommend, health, metrics, hot reload
                           (with --shards: the router of a document-sharded version)
recserve shard-server      serve one document shard of a model's index over gRPC
recserve cluster           up / status / restart / down: router, shards and embedding servers on 127.0.0.1
recserve soak              steady load on a local cluster with a hot reload and a shard restart
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

from recserve.cluster_cli import cluster_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
REPO = Path(__file__).resolve().parents[1]


# ---- security flags of serve, shard-server and embed-server (common/security.py) -------------
# Functions, not shared constants: each command gets its own option objects.
def _token_file_option() -> Any:
    return typer.Option(
        None, help="file holding the bearer token: admin calls need it (and serving calls, "
        "unless --no-auth-serving); health checks never do. A file, not a flag: ps shows flags",
    )  # fmt: skip


def _token_env_option() -> Any:
    return typer.Option(None, help="instead of --auth-token-file: env variable with the token")


def _auth_serving_option() -> Any:
    return typer.Option(
        None, "--auth-serving/--no-auth-serving",
        help="with a token: serving calls need it too (default), or only admin calls",
    )  # fmt: skip


def _tls_cert_option() -> Any:
    return typer.Option(None, help="PEM certificate chain: serve TLS only (with --tls-key)")


def _tls_key_option() -> Any:
    return typer.Option(None, help="PEM private key of --tls-cert")


def _tls_client_ca_option() -> Any:
    return typer.Option(None, help="PEM CA: clients must show a certificate it signed (mTLS)")


def _security(
    base: Any,
    token_file: Path | None,
    token_env: str | None,
    auth_serving: bool | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_client_ca: Path | None,
    **more: Any,
) -> Any:
    """The ``SecurityConfig`` of a command: ``base`` (serve.toml's, or None) with the security
    flags every server command takes applied (``more``: a command's own, e.g. ``upstream_ca``)."""
    from common.security import SecurityConfig

    return SecurityConfig.from_flags(
        base,
        token_file=token_file,
        token_env=token_env,
        auth_serving=auth_serving,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        **more,
    )


@app.command()
def demo(
    data: str = typer.Option("movielens", help="movielens (real ratings) or synthetic"),
    data_dir: Path = typer.Option(REPO / "data" / "ml-100k", help="MovieLens 100k folder"),
    epochs: int = typer.Option(8, min=1, help="training epochs"),
    k: int = typer.Option(100, min=1, help="recommendations per user (K)"),
    out: Path = typer.Option(
        REPO / "runs" / "demo", help="where the trained model folder is written"
    ),
    seed: int = typer.Option(0, help="random seed (data split, init, batches)"),
    quiet: bool = typer.Option(False, help="no progress bars"),
) -> None:
    """Train a small model, build the in-model index, print recommendations and recall."""
    from recserve.demo import run_demo

    run_demo(
        data=data, data_dir=data_dir, epochs=epochs, k=k, out=out, seed=seed, progress=not quiet
    )


@app.command("train")
def train_cmd(
    config: Path = typer.Option(
        ..., help="train.toml: [data] [model] [train] [evaluate] [publish]"
    ),
    out: Path = typer.Option(REPO / "runs" / "train", help="model folder, metrics, checkpoints"),
    resume: bool = typer.Option(False, help="continue from the last checkpoint"),
) -> None:
    """Train both towers (fbgemm fused tables), evaluate, save, and publish if configured.
    Under torchrun (--nproc_per_node N) tables are sharded across ranks."""
    import logging

    from recserve.train import run
    from retrieval.training.distributed import init_from_env
    from retrieval.training.train import TrainingDivergedError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ctx = init_from_env()
    try:
        run(config, out, resume, ctx)
    except (ValueError, TrainingDivergedError) as e:
        typer.echo(f"train: {e}", err=True)
        raise typer.Exit(2) from None
    finally:
        if ctx is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


@app.command("score")
def score_cmd(
    model_repo: Path = typer.Option(..., help="model repository"),
    users: Path = typer.Option(..., help="parquet: user_id, history, categorical, dense[, filter]"),
    out: Path = typer.Option(..., help="output folder (parts + _manifest.json); resumable"),
    model: str = typer.Option(None, help="model (default: the repository's only one)"),
    version: int = typer.Option(None, help="version (default: the latest)"),
    k: int = typer.Option(100, min=1, help="recommendations per user"),
    filter: str = typer.Option(None, help="eligibility filter for every user"),
    workers: int = typer.Option(2, min=1, help="worker processes (each loads the model once)"),
    chunk_rows: int = typer.Option(4096, min=1, help="users per output part"),
    overwrite: bool = typer.Option(False, help="replace an existing output folder"),
    quiet: bool = typer.Option(False, help="no progress bar"),
    engine: str = typer.Option(
        "local", help="local (worker processes, resumable) or ray (Ray Data; RAY_ADDRESS)"
    ),
) -> None:
    """Score a parquet file of users offline with a published model (continues a killed run)."""
    from retrieval.artifact import ShardMap
    from retrieval.batch_scoring import ScoreInputError, ScoreJob, score, score_ray
    from serving.repository.repository import ARTIFACT_DIR, ModelRepository

    try:
        name = _only_model(model_repo, model)
        vdir = ModelRepository(model_repo).verified_dir(name, version)
        if ShardMap.read(vdir / ARTIFACT_DIR) is not None:
            raise ValueError(
                f"--version: {name} v{vdir.name} is document-sharded; batch scoring needs an "
                "unsharded version (not built for sharded ones yet)"
            )
        job = ScoreJob(
            vdir / ARTIFACT_DIR, int(vdir.name), users, out, k, filter, chunk_rows,
            workers=workers, overwrite=overwrite,
        )  # fmt: skip
        if engine not in ("local", "ray"):
            raise ValueError(f"--engine: local or ray, got {engine!r}")
        manifest = score_ray(job) if engine == "ray" else score(job, progress=not quiet)
    except (ScoreInputError, ValueError, FileNotFoundError) as e:
        typer.echo(f"score: {e}", err=True)
        raise typer.Exit(2) from None
    rows = sum(v["rows"] for v in manifest["done"].values())
    typer.echo(f"scored {rows} users with {name} v{vdir.name} into {out}")


@app.command("fetch-movielens")
def fetch_movielens_cmd(
    out: Path = typer.Option(REPO / "data" / "ml-100k", help="target folder"),
) -> None:
    """Fetch MovieLens 100k (inside the recbole==1.2.1 wheel, from PyPI) into OUT."""
    from retrieval.data.movielens import fetch_movielens

    path = fetch_movielens(out)
    typer.echo(f"MovieLens 100k is in {path}")


@app.command(
    "bench-ann", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def bench_ann(ctx: typer.Context) -> None:
    """Run bench/ann.py (our index vs faiss); extra arguments pass through (try --help)."""
    raise typer.Exit(subprocess.call([sys.executable, str(REPO / "bench" / "ann.py"), *ctx.args]))


@app.command("embed-server")
def embed_server(
    port: int = typer.Option(..., min=0, max=65535, help="port to listen on (0: any free port)"),
    shard: Path = typer.Option(None, help="shard folder (manifest.json + packed rows)"),
    model_repo: Path = typer.Option(
        None, help="instead of --shard: a model repository; serves the latest version's rows"
    ),
    model: str = typer.Option(None, help="with --model-repo: the model (default: the only one)"),
    index: int = typer.Option(None, min=0, help="with --model-repo: which embedding server"),
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    memory_budget: str = typer.Option(
        "4GiB", help="refuse a shard larger than this (512MiB, 4GiB, bytes)"
    ),
    tables: str = typer.Option(
        "", help="comma-separated tables to serve (default: all in the shard)"
    ),
    auth_token_file: Path = _token_file_option(),
    auth_token_env: str = _token_env_option(),
    auth_serving: bool = _auth_serving_option(),
    tls_cert: Path = _tls_cert_option(),
    tls_key: Path = _tls_key_option(),
    tls_client_ca: Path = _tls_client_ca_option(),
) -> None:
    """Serve a shard of embedding rows over gRPC until SIGTERM or SIGINT (prints its address)."""
    from sharded_tables.remote.server import MemoryBudgetError, parse_size, serve

    names = [t.strip() for t in tables.split(",") if t.strip()] or None
    try:
        if (shard is None) == (model_repo is None):
            raise ValueError("give --shard DIR, or --model-repo DIR with --index N")
        if model_repo is not None:
            shard = _embedding_folder(model_repo, model, index)
        budget = parse_size(memory_budget, "--memory-budget")
        security = _security(
            None, auth_token_file, auth_token_env, auth_serving, tls_cert, tls_key, tls_client_ca
        ).load()
        security.warn_if_exposed(host, "embed-server")
        serve(
            shard, port=port, host=host, memory_budget=budget, tables=names,
            interceptors=security.interceptors(), credentials=security.grpc_credentials,
        )  # fmt: skip
    except (MemoryBudgetError, ValueError, OSError) as e:
        typer.echo(f"embed-server: {e}", err=True)
        raise typer.Exit(2) from None


def _only_model(model_repo: Path, model: str | None) -> str:
    """``model``, or the repository's only model (``ValueError`` naming --model otherwise)."""
    from serving.repository.repository import ModelRepository

    found = ModelRepository(model_repo).models()
    if model:
        if model not in found:
            raise ValueError(f"--model: no model {model!r} in {model_repo} (found: {found})")
        return model
    if len(found) != 1:
        raise ValueError(f"--model: {model_repo} holds models {found}; name one")
    return found[0]


def _embedding_folder(model_repo: Path, model: str | None, index: int | None) -> Path:
    """The latest version's rows for embedding server ``index``."""
    from serving.repository.repository import EMBEDDINGS_DIR, ModelRepository
    from sharded_tables.export import shard_folder

    if index is None:
        raise ValueError("--index: required with --model-repo (which embedding server)")
    name = _only_model(model_repo, model)
    vdir = ModelRepository(model_repo).verified_dir(name)
    folder = shard_folder(vdir / EMBEDDINGS_DIR, index)
    if not folder.is_dir():
        raise ValueError(f"--index: {name} version {vdir.name} has no rows for server {index}")
    return folder


@app.command("shard-server")
def shard_server_cmd(
    model_repo: Path = typer.Option(..., help="model repository with a document-sharded version"),
    shard: int = typer.Option(..., min=0, help="which shard of the catalog to serve"),
    model: str = typer.Option(None, help="model (default: the repository's only one)"),
    grpc_port: int = typer.Option(
        8101, min=0, max=65535, help="gRPC port: Search, health (0: any)"
    ),
    metrics_port: int = typer.Option(None, help="Prometheus /metrics port (default: off)"),
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    poll_s: float = typer.Option(1.0, min=0, help="seconds between repository checks (0: never)"),
    keep: int = typer.Option(2, min=1, help="versions kept loaded (a rollout needs 2)"),
    device: str = typer.Option("cpu", help="where the index lives: cpu or cuda"),
    torch_threads: int = typer.Option(0, min=0, help="intra-op threads (0: torch's default)"),
    auth_token_file: Path = _token_file_option(),
    auth_token_env: str = _token_env_option(),
    auth_serving: bool = _auth_serving_option(),
    tls_cert: Path = _tls_cert_option(),
    tls_key: Path = _tls_key_option(),
    tls_client_ca: Path = _tls_client_ca_option(),
) -> None:
    """Serve one document shard of a model's index until SIGTERM (prints its address)."""
    import logging

    import torch

    if torch_threads:
        torch.set_num_threads(torch_threads)

    from serving.repository.repository import ModelRepository
    from serving.sharding.shard_server import ShardServer, serve_shard

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        name = _only_model(model_repo, model)
        security = _security(
            None, auth_token_file, auth_token_env, auth_serving, tls_cert, tls_key, tls_client_ca
        ).load()
        server = ShardServer(
            ModelRepository(model_repo),
            name,
            shard,
            host=host,
            port=grpc_port,
            metrics_port=metrics_port,
            poll_s=poll_s,
            keep=keep,
            device=device,
            security=security,
        )
        serve_shard(server)
    except (ValueError, OSError) as e:
        typer.echo(f"shard-server: {e}", err=True)
        raise typer.Exit(2) from None


@app.command("serve")
def serve_cmd(
    model_repo: Path = typer.Option(
        None, help="model repository (<model>/config.pbtxt + versions)"
    ),
    model: str = typer.Option(None, help="model to serve (default: the repository's only one)"),
    grpc_port: int = typer.Option(None, help="gRPC port: Recommend, KServe v2, health (0: any)"),
    http_port: int = typer.Option(None, help="HTTP port: KServe v2 over HTTP (default: off)"),
    metrics_port: int = typer.Option(None, help="Prometheus /metrics port (default: off)"),
    host: str = typer.Option(None, help="address every listener binds (default 127.0.0.1)"),
    config: Path = typer.Option(None, help="serve.toml; flags override its values"),
    shards: str = typer.Option(
        None, help="route to shard servers: shards by ',', replicas by '|' (a:1|a:2,b:1)"
    ),
    shard_deadline_ms: float = typer.Option(None, help="router: deadline of a shard call"),
    hedge_after_ms: float = typer.Option(None, help="router: twin call to a replica after"),
    embedding_servers: str = typer.Option(
        None, help="router: embedding server addresses, comma-separated (server 0, 1, ...)"
    ),
    torch_threads: int = typer.Option(None, min=0, help="intra-op threads (0: torch's default)"),
    processes: int = typer.Option(
        None,
        min=1,
        help="serving processes sharing the ports (more use more cores; default 1)",
    ),
    state_dir: Path = typer.Option(
        None,
        help="serving state folder: turns on the admin API (live updates) and holds their logs",
    ),
    auth_token_file: Path = _token_file_option(),
    auth_token_env: str = _token_env_option(),
    auth_serving: bool = _auth_serving_option(),
    tls_cert: Path = _tls_cert_option(),
    tls_key: Path = _tls_key_option(),
    tls_client_ca: Path = _tls_client_ca_option(),
    upstream_ca: Path = typer.Option(
        None, help="router: PEM CA verifying the shard and embedding servers (calls use TLS)"
    ),
) -> None:
    """Serve a model of a repository over gRPC (and HTTP) until SIGTERM; prints one line when
    ready, hot-reloads new versions, drains on SIGTERM."""
    import logging

    from serving.app.config import ConfigError, ServeConfig
    from serving.app.main import serve
    from serving.app.processes import GroupStartError
    from serving.engine.host import NoLoadableVersionError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = ServeConfig.from_toml(config) if config is not None else ServeConfig()
        cfg = cfg.with_overrides(
            model_repo=model_repo,
            model=model,
            grpc_port=grpc_port,
            http_port=http_port,
            metrics_port=metrics_port,
            host=host,
            torch_threads=torch_threads,
            processes=processes,
            state_dir=state_dir,
        )
        cfg = _with_router_flags(cfg, shards, shard_deadline_ms, hedge_after_ms, embedding_servers)
        security = _security(
            cfg.security,
            auth_token_file,
            auth_token_env,
            auth_serving,
            tls_cert,
            tls_key,
            tls_client_ca,
            upstream_ca=upstream_ca,
        )
        serve(cfg.model_copy(update={"security": security}))
    except (ConfigError, NoLoadableVersionError, OSError, GroupStartError) as e:
        typer.echo(f"serve: {e}", err=True)
        raise typer.Exit(2) from None


app.add_typer(cluster_app, name="cluster")


@app.command("loadtest")
def loadtest_cmd(
    target: str = typer.Option(..., help="HOST:PORT of the gRPC or HTTP listener"),
    protocol: str = typer.Option("grpc", help="grpc (Recommend) or http (KServe v2 infer)"),
    model_repo: Path = typer.Option(..., help="model repository: shapes the requests"),
    model: str = typer.Option(None, help="model (default: the repository's only one)"),
    users: int = typer.Option(10, min=1, help="concurrent locust users"),
    spawn_rate: float = typer.Option(5.0, min=0.01, help="users started per second"),
    duration: float = typer.Option(30.0, min=1, help="seconds of load"),
    out: Path = typer.Option(REPO / "runs" / "loadtest", help="CSVs, summary.json, latency.png"),
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
        if protocol not in lt.USER_CLASSES:
            raise ValueError(f"--protocol: grpc or http, got {protocol!r}")
        shape = read_model_shape(model_repo, model)
        lt.check_target(target, protocol)
        spec = lt.LoadTestSpec(
            target, protocol, model_repo, shape.name, users, spawn_rate, duration, out
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


@app.command("soak")
def soak_cmd(
    minutes: float = typer.Option(None, min=0.1, help="how long to load (default: --seconds)"),
    seconds: float = typer.Option(60.0, min=6, help="how long to load, in seconds"),
    qps: float = typer.Option(50.0, min=0.1, max=2000, help="open-loop request rate"),
    items: int = typer.Option(20_000, min=1000, help="catalog size of the synthetic model"),
    shards: int = typer.Option(2, min=1, help="document shards"),
    replicas: int = typer.Option(2, min=2, help="replicas per shard (one is restarted)"),
    max_p99_ms: float = typer.Option(250.0, min=0.1, help="fail when p99 is over this"),
    deadline_ms: float = typer.Option(2000.0, min=1, help="each call's gRPC deadline"),
    out: Path = typer.Option(REPO / "runs" / "soak", help="work folders and soak.json"),
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


def _with_router_flags(
    cfg: Any,
    shards: str | None,
    deadline_ms: float | None,
    hedge_ms: float | None,
    embedding: str | None,
) -> Any:
    """The config with ``serve``'s router flags applied (any of them makes a router)."""
    from serving.sharding.config import RouterConfig, parse_shards

    flags = {
        "shards": parse_shards(shards) if shards is not None else None,
        "shard_deadline_ms": deadline_ms,
        "hedge_after_ms": hedge_ms,
        "embedding_servers": [a.strip() for a in embedding.split(",") if a.strip()]
        if embedding is not None
        else None,
    }
    given = {k: v for k, v in flags.items() if v is not None}
    if not given:
        return cfg
    return cfg.model_copy(update={"router": (cfg.router or RouterConfig()).updated(**given)})


def main() -> None:
    app()


if __name__ == "__main__":
    main()
