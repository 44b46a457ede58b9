"""Quality benchmark: recall@K and NDCG@K of held-out interactions, per table optimizer, table
dtype and index code format, on MovieLens 100k and on the synthetic set.

Per dataset (``prepare``: each user's latest 20 % of interactions held out, as ``make demo``)
and per table optimizer (``rowwise_adagrad``: fused fbgemm, the default; ``adam``: tables as
dense parameters), one model is trained per model seed (``--seeds`` of them from ``--seed``;
the data and its split stay fixed; table cells are means over the seeds) for ``--epochs``,
its IVF index built with INT8 codes (nprobe tuned for recall 0.97 against exact search, as the
demo), and every held-out user is asked for top-K by:

* the float model through its index (INT8 codes), through an index rebuilt with FP8 codes,
  and by exact search (``model(batch, k, exact=True)``);
* the model with its tables quantized to FP16 / FP8 / INT8 / INT4
  (``retrieval.tiering.tier_model``; the index is the float model's, as published models
  serve); with ``--rebuild-quantized`` also with the index rebuilt from the quantized tables'
  item vectors (what a model tiered before its index is built would serve);
* the float model and the INT8-table model excluding only the history window (the model's
  behaviour for a request without a seen list);
* the float model published with 2 document shards and answered by the router's forward
  (``RouterRunner``, shards searched in this process through the wire encoding);
* the baselines (``bench/quality_baselines.py``): popularity, item-kNN (cosine) and EASE,
  their setting tuned on a validation split cut from the training part.

Every method excludes every item the user consumed before the test split (``prep.seen``: the
request's seen list, ``retrieval/seen.py``) unless its label says "window only"; the baselines
are scored both ways. Reported: recall@{10,K}, NDCG@{10,K} and catalog coverage@K (the share of
the catalog in some user's top-K).

Index recall@K against exact search of the same vectors is reported for both code formats, and
the float model's spread over seeds. Deterministic for given seeds (torch and numpy seeded,
``--threads`` fixed: two runs give identical metrics).

Run from the repository root (MovieLens needs ``make data``)::

    .venv/bin/python bench/quality.py --small         # ~40 s: 2 epochs, 1 seed
    .venv/bin/python bench/quality.py                 # 8 epochs, 3 seeds: ~3.5 min on 2 cores

Writes ``--out`` (default ``bench/results/quality.json``, ``quality_small.json`` with
``--small``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quality_baselines import baseline_recs
from quality_report import FLOAT_IVF, INT8_IVF, ROUTED, WINDOW, markdown
from sharding_inprocess import LocalShards

from retrieval.data import RecDataset, SyntheticConfig, generate, load_movielens
from retrieval.index.exact import recall_at_k
from retrieval.metrics import catalog_coverage, ranking_metrics
from retrieval.model import RetrievalModel
from retrieval.tiering import tier_model
from retrieval.training.prepare import Prepared, prepare
from retrieval.training.train import TrainConfig, train
from serving.repository.repository import ModelRepository
from serving.sharding.router import RouterRunner
from sharded_tables.placement import Budgets
from sharded_tables.specs import DType

OPTIMIZERS = ("rowwise_adagrad", "adam")
TABLE_DTYPES = (DType.FP16, DType.FP8, DType.INT8, DType.INT4)
ALL_IN_HOST = Budgets(device=0, host=1 << 40)
"""Every table in the host tier: only the dtype changes."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="2 epochs (a quick check)")
    p.add_argument("--datasets", default="movielens,synthetic", help="comma-separated")
    p.add_argument("--users", type=int, default=2000, help="synthetic users (the demo's set)")
    p.add_argument("--items", type=int, default=5000, help="synthetic items")
    p.add_argument("--data-dir", type=Path, default=Path("data/ml-100k"))
    p.add_argument("--epochs", type=int, help="training epochs (default 8 as make demo; 2 --small)")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--eval-users", type=int, default=0, help="at most this many users (0: all)")
    p.add_argument("--rebuild-quantized", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--tune-validation",
        type=float,
        default=0.2,
        help="share of each user's training interactions the baselines are tuned on",
    )
    p.add_argument("--seed", type=int, default=0, help="data seed and first model seed")
    p.add_argument(
        "--seeds", type=int, help="model seeds per optimizer, averaged (default 3; 1 --small)"
    )
    p.add_argument(
        "--history",
        choices=("causal", "static"),
        default="causal",
        help="training pairs' histories (train.history; static: the model before 2026-11-25)",
    )
    p.add_argument("--recent-len", type=int, default=5, help="model.recent_len (0: off)")
    p.add_argument("--hard-negatives", type=int, default=0, help="train.hard_negatives")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.epochs = args.epochs or (2 if args.small else 8)
    args.seeds = args.seeds or (1 if args.small else 3)
    if args.out is None:
        args.out = Path("bench/results") / ("quality_small.json" if args.small else "quality.json")
    return args


# ---- data and training ------------------------------------------------------------------------
def load_dataset(name: str, args: argparse.Namespace) -> RecDataset:
    """MovieLens 100k from ``--data-dir`` or the synthetic set of ``--users`` x ``--items``."""
    if name == "movielens":
        return load_movielens(args.data_dir)
    if name == "synthetic":
        return generate(SyntheticConfig(num_users=args.users, num_items=args.items, seed=args.seed))
    raise ValueError(f"unknown dataset {name!r} (movielens, synthetic)")


def trained_model(
    prep: Prepared, table_optimizer: str, args: argparse.Namespace, seed: int
) -> tuple[RetrievalModel, list[float]]:
    """A seeded model trained on ``prep`` with its INT8-code index built (as the demo)."""
    torch.manual_seed(seed)
    config = prep.config.model_copy(update={"recent_len": args.recent_len}, deep=True)
    model = RetrievalModel(config)  # build_index rewrites config.index
    cfg = TrainConfig(
        epochs=args.epochs,
        seed=seed,
        progress=False,
        table_optimizer=table_optimizer,
        history=args.history,
        hard_negatives=args.hard_negatives,
    )
    losses = train(model, prep.train, cfg)
    build_index(model, prep, seed)
    return model, losses


def build_index(model: RetrievalModel, prep: Prepared, seed: int) -> None:
    """(Re)builds ``model``'s index from its own item tower, nprobe tuned on sample users."""
    ds = prep.dataset
    model.build_index(prep.train.item_features, ds.item_attributes, prep.tune_batch(seed=seed))


def with_codes(model: RetrievalModel, prep: Prepared, codes: str, seed: int) -> RetrievalModel:
    """A deep copy of ``model`` whose index is rebuilt with ``codes`` ("int8" / "fp8")."""
    other = copy.deepcopy(model)
    other.config.index = other.config.index.model_copy(update={"codes": codes})
    build_index(other, prep, seed)
    return other


# ---- evaluation -------------------------------------------------------------------------------
def recommend(
    model: RetrievalModel,
    prep: Prepared,
    users: np.ndarray,
    k: int,
    exact: bool = False,
    chunk: int = 512,
    seen: bool = True,
) -> np.ndarray:
    """Top-``k`` item ids ``[U, k]`` for ``users``, in chunks; every item a user consumed
    before the test split excluded (``seen``), else the history window only."""
    out = []
    with torch.no_grad():
        for s in range(0, len(users), chunk):
            batch = prep.user_batch(users[s : s + chunk], seen=prep.seen if seen else None)
            out.append(model(batch, k, exact=exact)[0].numpy())
    return np.concatenate(out)


@dataclasses.dataclass
class Evaluation:
    """Held-out users of one dataset and what a variant's recommendations score."""

    prep: Prepared
    users: np.ndarray
    k: int

    @property
    def relevant(self) -> list[set[int]]:
        return [self.prep.test_items[u] for u in self.users]

    def score(self, recs: np.ndarray) -> dict[str, float]:
        """recall and NDCG at K ("recall", "ndcg") and at 10, coverage@K, the users counted."""
        k, n = self.k, self.prep.dataset.num_items
        m = ranking_metrics(recs, self.relevant, k)
        out = {"recall": m[f"recall@{k}"], "ndcg": m[f"ndcg@{k}"], "users": m["users"]}
        if k > 10:
            m10 = ranking_metrics(recs, self.relevant, 10)
            out.update({"recall@10": m10["recall@10"], "ndcg@10": m10["ndcg@10"]})
        out["coverage"] = catalog_coverage(recs, n, k)
        return out

    def recs(self, model: RetrievalModel, exact: bool = False, seen: bool = True) -> np.ndarray:
        return recommend(model, self.prep, self.users, self.k, exact=exact, seen=seen)


def held_out_users(prep: Prepared, limit: int) -> np.ndarray:
    """Users with at least one held-out interaction (the first ``limit``, 0: all)."""
    users = np.array([u for u in range(prep.dataset.num_users) if prep.test_items[u]])
    return users[:limit] if limit else users


def variants(
    model: RetrievalModel, ev: Evaluation, seed: int, rebuild: bool
) -> dict[str, Callable[[], np.ndarray]]:
    """``{row label: () -> recs}`` for one trained model, in table order."""
    out: dict[str, Callable[[], np.ndarray]] = {
        FLOAT_IVF: lambda: ev.recs(model),
        "float tables, IVF FP8 codes": lambda: ev.recs(with_codes(model, ev.prep, "fp8", seed)),
        "float tables, exact search": lambda: ev.recs(model, exact=True),
        f"{FLOAT_IVF}, {WINDOW}": lambda: ev.recs(model, seen=False),
        ROUTED: lambda: routed_recs(model, ev),
    }
    for dtype in TABLE_DTYPES:
        out[f"{dtype.value.upper()} tables, IVF INT8 codes"] = _tiered(model, ev, dtype)
    out[f"{INT8_IVF}, {WINDOW}"] = _tiered(model, ev, DType.INT8, seen=False)
    if rebuild:
        for dtype in TABLE_DTYPES:
            label = f"{dtype.value.upper()} tables, INT8-code index rebuilt from them"
            out[label] = _tiered(model, ev, dtype, rebuild_seed=seed)
    return out


def routed_recs(model: RetrievalModel, ev: Evaluation, shards: int = 2) -> np.ndarray:
    """Recs through the router's forward (``RouterRunner``) over ``shards`` document shards of
    the published model, each searched in this process with the wire encoding
    (``bench/sharding_inprocess.py``'s ``LocalShards``): what a routed deployment answers."""
    with tempfile.TemporaryDirectory() as root:
        repo = ModelRepository(Path(root))
        version = repo.publish("quality", model, shards=shards)
        router_model = repo.load("quality", version).model
        indexes = [repo.load_shard("quality", version, s)[0] for s in range(shards)]
        runner = RouterRunner(router_model, "quality", version, LocalShards(indexes, version))  # type: ignore[arg-type]
        out = []
        with torch.no_grad():
            for s in range(0, len(ev.users), 512):
                batch = ev.prep.user_batch(ev.users[s : s + 512], seen=ev.prep.seen)
                out.append(runner.forward(batch, ev.k, None)[0].numpy())
    return np.concatenate(out)


def _tiered(
    model: RetrievalModel,
    ev: Evaluation,
    dtype: DType,
    rebuild_seed: int | None = None,
    seen: bool = True,
) -> Callable[[], np.ndarray]:
    """Recs of ``model`` with ``dtype`` tables; the index rebuilt from them when a seed is given."""

    def run() -> np.ndarray:
        tiered, _ = tier_model(model, ALL_IN_HOST, dtype=dtype)
        if rebuild_seed is not None:
            build_index(tiered, ev.prep, rebuild_seed)
        return ev.recs(tiered, seen=seen)

    return run


def evaluate_model(
    model: RetrievalModel, ev: Evaluation, seed: int, rebuild: bool
) -> dict[str, Any]:
    """Every variant's metrics, plus the index's recall against exact search per code format."""
    rows, recs = {}, {}
    for label, fn in variants(model, ev, seed, rebuild).items():
        recs[label] = fn()
        rows[label] = ev.score(recs[label])
    exact = torch.from_numpy(recs["float tables, exact search"])
    index_recall = {
        codes: recall_at_k(torch.from_numpy(recs[f"float tables, IVF {codes} codes"]), exact)
        for codes in ("INT8", "FP8")
    }
    return {
        "rows": rows,
        "index_recall_vs_exact": index_recall,
        "nprobe": model.config.index.nprobe,
        "forward_ms": forward_ms(model, ev),
    }


def forward_ms(model: RetrievalModel, ev: Evaluation, users: int = 200) -> float:
    """Median ms of one user's forward (batch of 1, K, seen list, INT8-code index): what
    serving pays per request beside the quality it buys."""
    times = []
    with torch.no_grad():
        for u in ev.users[:users]:
            batch = ev.prep.user_batch(np.array([u]), seen=ev.prep.seen)
            t0 = time.perf_counter()
            model(batch, ev.k)
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def bench_dataset(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Trains one model per table optimizer and model seed on one dataset (the data and its
    split stay fixed) and evaluates every variant; rows are means over the seeds."""
    ds = load_dataset(name, args)
    prep = prepare(ds)
    ev = Evaluation(prep, held_out_users(prep, args.eval_users), args.k)
    t0 = time.perf_counter()
    recs, tuning = baseline_recs(prep, ev.users, args.k, args.tune_validation)
    baselines = {
        name: {m: ev.score(r) for m, r in by_mode.items()} for name, by_mode in recs.items()
    }
    baselines_s = time.perf_counter() - t0
    runs: dict[str, list[dict[str, Any]]] = {}
    for opt in OPTIMIZERS:
        runs[opt] = []
        for seed in range(args.seed, args.seed + args.seeds):
            t0 = time.perf_counter()
            model, losses = trained_model(prep, opt, args, seed)
            train_s = time.perf_counter() - t0
            scored = evaluate_model(model, ev, seed, args.rebuild_quantized)
            scored.update(seed=seed, epoch_losses=losses, train_s=train_s)
            scored["total_s"] = time.perf_counter() - t0
            runs[opt].append(scored)
    return {
        "dataset": ds.name,
        "users": ds.num_users,
        "items": ds.num_items,
        "eval_users": len(ev.users),
        "seen_items": seen_sizes(prep, ev.users),
        "baselines": baselines,
        "baseline_tuning": tuning,
        "baselines_s": baselines_s,
        "models": {opt: aggregate(r) for opt, r in runs.items()},
        "runs": runs,
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and (population) standard deviation over seeds of every variant's metrics."""
    rows: dict[str, dict[str, float]] = {}
    for label, first in runs[0]["rows"].items():
        rows[label] = {}
        for key in first:
            values = [r["rows"][label][key] for r in runs]
            rows[label][key] = float(np.mean(values))
            if key in ("recall", "ndcg"):
                rows[label][f"{key}_std"] = float(np.std(values))
    index_recall = {
        c: float(np.mean([r["index_recall_vs_exact"][c] for r in runs]))
        for c in runs[0]["index_recall_vs_exact"]
    }
    return {
        "rows": rows,
        "index_recall_vs_exact": index_recall,
        "nprobe": [r["nprobe"] for r in runs],
        "first_epoch_loss": float(np.mean([r["epoch_losses"][0] for r in runs])),
        "last_epoch_loss": float(np.mean([r["epoch_losses"][-1] for r in runs])),
        "epochs": len(runs[0]["epoch_losses"]),
        "train_s": float(np.mean([r["train_s"] for r in runs])),
        "forward_ms": float(np.mean([r["forward_ms"] for r in runs])),
        "seeds": [r["seed"] for r in runs],
    }


# ---- output -----------------------------------------------------------------------------------
def seen_sizes(prep: Prepared, users: np.ndarray) -> dict[str, float]:
    """How long the evaluated users' seen lists are, and the bytes the store takes."""
    assert prep.seen is not None
    lengths = prep.seen.lengths(users)
    return {
        "mean": float(lengths.mean()),
        "median": float(np.median(lengths)),
        "max": int(lengths.max()),
        "over_window": int((lengths > prep.config.history_len).sum()),
        "store_bytes": prep.seen.nbytes(),
    }


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Versions, settings and machine load."""
    return {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "epochs": args.epochs,
        "k": args.k,
        "seed": args.seed,
        "seeds": args.seeds,
        "history": args.history,
        "recent_len": args.recent_len,
        "hard_negatives": args.hard_negatives,
        "argv": sys.argv[1:],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    np.random.seed(args.seed)
    env = environment(args)
    results = []
    for name in args.datasets.split(","):
        result = bench_dataset(name.strip(), args)
        print(markdown(result, args.k) + "\n", flush=True)
        results.append(result)
    env["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": env, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
