"""Hashed raw-id tables in training: quality of a small working table, rows moved to and from
the embedding servers.

The same model (MovieLens 100k by default) trains three times, same seed, same batches:

* ``no raw_id``: the data's user features only (the reference);
* ``all resident``: plus the hashed feature ``raw_id`` with a working table of every user (no
  row ever leaves the process);
* ``working N%``: the same with a working table of ``--share`` of the users (at least a batch):
  rows and their optimizer state go to a real ``recserve serve training-store`` process and
  come back.

Each run reports test recall@K / NDCG@K (every item a user saw before the split excluded),
training examples/s, and the rows moved (evicted: written with their state; restored: read
back; fresh: admitted for the first time) per second of training.

Run from the repository root::

    .venv/bin/python bench/hashed.py                       # MovieLens, 3 runs, ~2 min
    .venv/bin/python bench/hashed.py --data synthetic --users 20000

Writes ``--out`` (default ``bench/results/hashed.json``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import process
from retrieval.data import SyntheticConfig, generate, load_movielens
from retrieval.data.schema import RecDataset
from retrieval.model import RetrievalModel
from retrieval.training.config import EvaluateConfig, HashedConfig, ModelSection, TrainConfig
from retrieval.training.run import evaluator, prepare_run
from retrieval.training.train import Trainer
from sharded_tables.hashed_training import state_width


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", choices=["movielens", "synthetic"], default="movielens")
    p.add_argument("--data-dir", type=Path, default=Path("data/ml-100k"))
    p.add_argument("--users", type=int, default=20_000, help="synthetic users")
    p.add_argument("--items", type=int, default=20_000, help="synthetic items")
    p.add_argument("--share", type=float, default=0.25, help="working rows / users")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/hashed.json"))
    return p.parse_args(argv)


def dataset(args: argparse.Namespace) -> RecDataset:
    if args.data == "movielens":
        return load_movielens(args.data_dir)
    return generate(SyntheticConfig(num_users=args.users, num_items=args.items, seed=args.seed))


def start_store(folder: Path, width: int) -> tuple[process.Proc, str]:
    """A ``recserve serve training-store`` process on a free port -> (process, address)."""
    cmd = [sys.executable, "-m", "recserve", "serve", "training-store", "--folder", str(folder),
           "--table", f"user_raw_id:{width}", "--grpc-port", "0", "--memory-budget", "8GiB"]  # fmt: skip
    proc = process.start(cmd, log_path=folder.parent / f"{folder.name}.log")
    ready = proc.wait_ready(60.0)
    assert ready.grpc
    return proc, ready.grpc


def run_case(args: argparse.Namespace, name: str, working: int, tmp: Path) -> dict[str, Any]:
    """Trains and evaluates one case (``working`` 0: no raw_id feature)."""
    ds = dataset(args)
    prep = prepare_run(ds, ModelSection(hashed_user_id=working))
    cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch, seed=args.seed, progress=False)
    proc = None
    if working:
        d = prep.config.embedding_dim
        width = d + state_width(cfg.table_optimizer, d)
        proc, address = start_store(tmp / name.replace(" ", "_"), width)
        cfg = cfg.model_copy(update={"hashed": HashedConfig(servers=[address])})
    try:
        torch.manual_seed(args.seed)
        model = RetrievalModel(prep.config)
        trainer = Trainer(model, prep.train, cfg)
        t0 = time.perf_counter()
        trainer.fit()
        seconds = time.perf_counter() - t0
        metrics = evaluator(prep, EvaluateConfig(k=args.k, users=0, validation=0), "test")(model)
    finally:
        if proc is not None:
            process.stop_all([proc], timeout_s=5.0)
    moved = trainer.hashed.moved if trainer.hashed is not None else None
    examples = args.epochs * (len(prep.train.user_ids) // args.batch) * args.batch
    out: dict[str, Any] = {
        "case": name,
        "working_rows": working,
        "users": ds.num_users,
        "train_s": seconds,
        "examples_per_s": examples / seconds,
        **{k: float(v) for k, v in metrics.items()},
    }
    if moved is not None:
        out.update(evicted=moved.evicted, restored=moved.restored, fresh=moved.fresh)
        out["rows_moved_per_s"] = (moved.evicted + moved.restored) / seconds
    return out


def markdown(rows: list[dict[str, Any]], k: int) -> str:
    def cell(r: dict[str, Any], key: str, spec: str) -> str:
        return format(r[key], spec) if r.get(key) is not None else "—"

    lines = [
        f"| case | working rows | recall@{k} | ndcg@{k} | examples/s | evicted | restored "
        "| rows moved/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["case"], str(r["working_rows"] or "—"), cell(r, f"recall@{k}", ".4f"),
                 cell(r, f"ndcg@{k}", ".4f"), cell(r, "examples_per_s", ".0f"),
                 cell(r, "evicted", "d"), cell(r, "restored", "d"),
                 cell(r, "rows_moved_per_s", ".0f")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    users = dataset(args).num_users
    working = max(args.batch, int(np.ceil(args.share * users)))
    cases = [("no raw_id", 0), ("all resident", max(args.batch, users)),
             (f"working {working / users:.0%}", working)]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, rows_kept in cases:
            rows.append(run_case(args, name, rows_kept, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(markdown(rows, args.k))


if __name__ == "__main__":
    main()
