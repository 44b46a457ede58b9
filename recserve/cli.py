"""``recserve`` command line: jobs, and groups of them.

recserve demo                train on MovieLens 100k (or --data FOLDER: your own), build the index, print
                             recommendations and recall
recserve train               train from a config (torchrun for several processes), evaluate, publish
recserve score               score a parquet file of users offline with a published model
recserve serve model         serve a model repository: gRPC Recommend, KServe v2, health, metrics, hot reload
recserve serve router        the router of a document-sharded version (--shards)
recserve serve shard         one document shard of a model's index
recserve serve embeddings    one embedding server's rows (the remote tier)
recserve cluster             up / status / restart / down: router, shards and embedding servers on 127.0.0.1
recserve test load           locust (gRPC or HTTP users) against a server, with a summary and a plot
recserve test soak           steady load on a local cluster with a hot reload and a shard restart
recserve bench NAME          run ./bench/NAME.py (e.g. ann: the index vs faiss)
recserve kernels             compile the C++ kernels for this machine now (make does at install)
recserve data movielens      extract MovieLens 100k from the recbole wheel into data/ml-100k
recserve data import         your own CSV / parquet interaction log (+ items, users) -> a data set folder

Paths default to folders under the current directory (runs/, data/): run it from where they
should go (the Makefile runs from the checkout).
"""

from __future__ import annotations

import subprocess
import sys
from enum import StrEnum
from pathlib import Path

import typer

from recserve.cluster_cli import cluster_app
from recserve.data_cli import data_app
from recserve.loadtest_cli import test_app
from recserve.serve_cli import only_model, serve_app

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Recommendation retrieval as one PyTorch model: train it, serve it, test and bench it. "
    "Paths default to folders under the current directory (runs/, data/, bench/).",
)


class ScoreEngine(StrEnum):
    """How ``score`` runs: worker processes on this machine, or Ray Data."""

    local = "local"
    ray = "ray"


@app.command()
def demo(
    data: str = typer.Option(
        "movielens",
        help="movielens (real ratings), synthetic, or a folder of your own data "
        "(`recserve data import --out FOLDER`)",
    ),
    data_dir: Path = typer.Option(Path("data/ml-100k"), help="MovieLens 100k folder"),
    epochs: int = typer.Option(8, min=1, help="training epochs"),
    k: int = typer.Option(100, min=1, help="recommendations per user (K)"),
    out: Path = typer.Option(Path("runs/demo"), help="where the trained model folder is written"),
    seed: int = typer.Option(0, help="random seed (data split, init, batches)"),
    quiet: bool = typer.Option(False, help="no progress bars"),
) -> None:
    """Train a small model, build the in-model index, print recommendations and recall."""
    from recserve.demo import DemoDataError, run_demo

    try:
        run_demo(
            data=data,
            data_dir=data_dir,
            epochs=epochs,
            k=k,
            out=out,
            seed=seed,
            progress=not quiet,
        )
    except DemoDataError as e:
        typer.echo(f"demo: {e}", err=True)
        raise typer.Exit(2) from None


@app.command("train")
def train_cmd(
    config: Path = typer.Option(
        ..., help="train.toml: [data] [model] [train] [evaluate] [publish]"
    ),
    out: Path = typer.Option(Path("runs/train"), help="model folder, metrics, checkpoints"),
    resume: bool = typer.Option(False, help="continue from the last checkpoint"),
) -> None:
    """Train both towers (fbgemm fused tables), evaluate, save, and publish if configured.
    Under torchrun (--nproc_per_node N) tables are sharded across ranks."""
    import logging

    from recserve.train import run
    from retrieval.training.distributed import init_from_env, leave_job
    from retrieval.training.train import TrainingDivergedError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ctx = init_from_env()
    try:
        run(config, out, resume, ctx)
        code = 0
    except (ValueError, TrainingDivergedError) as e:
        typer.echo(f"train: {e}", err=True)
        code = 2
    except BaseException:
        if ctx is not None:  # the traceback still prints
            import torch.distributed as dist

            dist.destroy_process_group()
        raise
    if ctx is not None:
        leave_job(code)  # does not return
    if code:
        raise typer.Exit(code)


@app.command("score")
def score_cmd(
    model_repo: Path = typer.Option(..., help="model repository"),
    users: Path = typer.Option(..., help="parquet: user_id, history, categorical, dense[, filter]"),
    out: Path = typer.Option(..., help="output folder (parts + _manifest.json); resumable"),
    model: str = typer.Option(None, help="model (default: the repository's only one)"),
    version: int = typer.Option(None, help="version (default: the latest)"),
    k: int = typer.Option(100, min=1, help="recommendations per user"),
    filter: str = typer.Option(None, help="eligibility filter for every user"),
    recall_target: float = typer.Option(
        0.0, help="recall@K vs exact search every user asks for, in (0, 1]; 0: the index's settings"
    ),
    workers: int = typer.Option(2, min=1, help="worker processes (each loads the model once)"),
    chunk_rows: int = typer.Option(4096, min=1, help="users per output part"),
    overwrite: bool = typer.Option(False, help="replace an existing output folder"),
    quiet: bool = typer.Option(False, help="no progress bar"),
    engine: ScoreEngine = typer.Option(
        ScoreEngine.local, help="local (worker processes, resumable) or ray (Ray Data; RAY_ADDRESS)"
    ),
    device: str = typer.Option(
        "cpu", help="where each worker runs the model: cpu, cuda or cuda:N (one worker per GPU)"
    ),
) -> None:
    """Score a parquet file of users offline with a published model (continues a killed run)."""
    from common.devices import check_device
    from retrieval.batch_scoring import RayStartTimeout, ScoreInputError, ScoreJob, score, score_ray
    from serving.repository.repository import (
        ARTIFACT_DIR,
        EMBEDDINGS_DIR,
        SHARDS_DIR,
        ModelRepository,
    )

    try:
        check_device(device, "--device")
        name = only_model(model_repo, model)
        vdir = ModelRepository(model_repo).verified_dir(name, version)
        # a sharded / tiered version is scored whole: each worker merges its shards and reads
        # its remote tables' rows from the version folder (retrieval.artifact.load_whole_model)
        shards, embeddings = vdir / SHARDS_DIR, vdir / EMBEDDINGS_DIR
        job = ScoreJob(
            vdir / ARTIFACT_DIR, int(vdir.name), users, out, k, filter, chunk_rows,
            workers=workers, overwrite=overwrite,
            shards_dir=shards if shards.is_dir() else None,
            embeddings_dir=embeddings if embeddings.is_dir() else None,
            recall_target=recall_target, device=device,
        )  # fmt: skip
        manifest = score_ray(job) if engine is ScoreEngine.ray else score(job, progress=not quiet)
    except (ScoreInputError, RayStartTimeout, ValueError, FileNotFoundError) as e:
        typer.echo(f"score: {e}", err=True)
        raise typer.Exit(2) from None
    rows = sum(v["rows"] for v in manifest["done"].values())
    typer.echo(f"scored {rows} users with {name} v{vdir.name} into {out}")


app.add_typer(serve_app, name="serve")
app.add_typer(cluster_app, name="cluster")
app.add_typer(test_app, name="test")
app.add_typer(data_app, name="data")


@app.command("kernels")
def kernels_cmd() -> None:
    """Compile the C++ kernels (IVF scan, nearest centroid, pooled lookup, id map) for this
    machine now, so that no build, search or request waits for a compiler (`make` runs it at install; a container
    built elsewhere compiles them at its first start, for its own CPU)."""
    import time

    from retrieval.index.kmeans import build_kernel as build_nearest
    from retrieval.index.scan import int8_isa
    from sharded_tables.idmap import build_kernel as build_idmap
    from sharded_tables.pooled_lookup import build_kernel as build_lookup

    for name, build in (
        ("IVF scan", int8_isa),
        ("nearest centroid", build_nearest),
        ("pooled lookup", build_lookup),
        ("id map", build_idmap),
    ):
        t0 = time.perf_counter()
        build()
        typer.echo(f"{name}: ready ({time.perf_counter() - t0:.1f} s)")
    typer.echo(f"int8 scan path on this CPU: {int8_isa()}")


@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="benchmark: runs ./bench/NAME.py (ann, serving, ...)"),
) -> None:
    """Run ./bench/NAME.py from the current directory (a checkout); extra arguments pass
    through (try `recserve bench ann --help`)."""
    script = Path("bench") / f"{name}.py"
    if not script.is_file():
        found = sorted(p.stem for p in Path("bench").glob("*.py")) if Path("bench").is_dir() else []
        typer.echo(
            f"bench: no {script} here ({Path.cwd()}); run it from a recserve checkout"
            + (f" (benchmarks: {', '.join(found)})" if found else ""),
            err=True,
        )
        raise typer.Exit(2)
    raise typer.Exit(subprocess.call([sys.executable, str(script), *ctx.args]))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
