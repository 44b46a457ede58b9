"""``recserve`` command line: one subcommand per job.

recserve demo              train on MovieLens 100k, build the index, print recommendations and recall
recserve fetch-movielens   extract MovieLens 100k from the recbole wheel into data/ml-100k
recserve bench-ann         the index benchmark (bench/ann.py) vs faiss
recserve embed-server      serve one shard of embedding rows (the remote tier) over gRPC
recserve serve             serve a model repository: gRPC Recommend, health, metrics, hot reload
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
REPO = Path(__file__).resolve().parents[1]


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
    shard: Path = typer.Option(..., help="shard folder (manifest.json + packed rows)"),
    port: int = typer.Option(..., min=0, max=65535, help="port to listen on (0: any free port)"),
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    memory_budget: str = typer.Option(
        "4GiB", help="refuse a shard larger than this (512MiB, 4GiB, bytes)"
    ),
    tables: str = typer.Option(
        "", help="comma-separated tables to serve (default: all in the shard)"
    ),
) -> None:
    """Serve a shard of embedding rows over gRPC until SIGTERM or SIGINT (prints its address)."""
    from sharded_tables.remote.server import MemoryBudgetError, parse_size, serve

    names = [t.strip() for t in tables.split(",") if t.strip()] or None
    try:
        budget = parse_size(memory_budget, "--memory-budget")
        serve(shard, port=port, host=host, memory_budget=budget, tables=names)
    except (MemoryBudgetError, ValueError, OSError) as e:
        typer.echo(f"embed-server: {e}", err=True)
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
) -> None:
    """Serve a model of a repository over gRPC (and HTTP) until SIGTERM; prints one line when
    ready, hot-reloads new versions, drains on SIGTERM."""
    import logging

    from serving.config import ConfigError, ServeConfig
    from serving.host import NoLoadableVersionError
    from serving.main import serve

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
        )
        serve(cfg)
    except (ConfigError, NoLoadableVersionError, OSError) as e:
        typer.echo(f"serve: {e}", err=True)
        raise typer.Exit(2) from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
