"""``recserve`` command line: one subcommand per job.

recserve demo              train on MovieLens 100k, build the index, print recommendations and recall
recserve fetch-movielens   extract MovieLens 100k from the recbole wheel into data/ml-100k
recserve bench-ann         the index benchmark (bench/ann.py) vs faiss
recserve embed-server      serve one shard of embedding rows (the remote tier) over gRPC
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
