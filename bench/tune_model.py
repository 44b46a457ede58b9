"""Our model's temperature and regularisation tuned on a validation split, never the test split.

The quality benchmark (``bench/quality.py``) reports the test split with the model's defaults;
this sweep says whether those defaults are the ones a validation split picks. The split is the
baselines' (``bench/quality_baselines.py``): the latest ``--validation`` share of each user's
*training* interactions is held out, the model trains on the rest, and validation recall@K /
NDCG@K are measured with every earlier item excluded (``retrieval.training.run.evaluator``).
The test split is not read. Grid: ``model.temperature`` x ``train.weight_decay``, one model per
point and seed, the same epochs and optimizer as the quality benchmark.

Run from the repository root::

    .venv/bin/python bench/tune_model.py --datasets movielens        # ~3 min
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quality import load_dataset

from common.atomic import atomic_write_json
from retrieval.model import RetrievalModel
from retrieval.training.config import EvaluateConfig
from retrieval.training.prepare import prepare
from retrieval.training.run import evaluator
from retrieval.training.train import TrainConfig, train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--datasets", default="movielens", help="comma-separated")
    p.add_argument("--data-dir", type=Path, default=Path("data/ml-100k"))
    p.add_argument("--users", type=int, default=2000)
    p.add_argument("--items", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--validation", type=float, default=0.1)
    p.add_argument("--temperatures", default="0.02,0.05,0.1,0.2")
    p.add_argument("--weight-decays", default="0,1e-5,1e-4")
    p.add_argument("--out", type=Path, default=Path("bench/results/tune_model.json"))
    return p.parse_args(argv)


def sweep(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ds = load_dataset(name, args)
    prep = prepare(ds, validation=args.validation)  # train = training part less validation
    evaluate = evaluator(prep, EvaluateConfig(k=args.k, users=0), "validation")
    points = []
    for t in (float(x) for x in args.temperatures.split(",")):
        for wd in (float(x) for x in args.weight_decays.split(",")):
            scores = []
            t0 = time.perf_counter()
            for seed in range(args.seed, args.seed + args.seeds):
                torch.manual_seed(seed)
                model = RetrievalModel(prep.config.model_copy(update={"temperature": t}, deep=True))
                cfg = TrainConfig(epochs=args.epochs, seed=seed, progress=False, weight_decay=wd)
                train(model, prep.train, cfg)
                scores.append(evaluate(model))
            mean = {m: sum(s[m] for s in scores) / len(scores) for m in scores[0]}
            points.append(
                {"temperature": t, "weight_decay": wd, **mean, "s": time.perf_counter() - t0}
            )
            print(f"{name} t={t} wd={wd}: {mean}", file=sys.stderr, flush=True)
    key = f"recall@{args.k}"
    best = max(points, key=lambda p: p[key])
    return {"dataset": ds.name, "points": points, "best": best}


def markdown(results: list[dict[str, Any]], k: int) -> str:
    lines = []
    for r in results:
        lines += [
            f"**{r['dataset']}**, validation split (best: temperature {r['best']['temperature']:g}, "
            f"weight decay {r['best']['weight_decay']:g})",
            "",
            f"| temperature | weight decay | recall@{k} | NDCG@{k} |",
            "|---|---|---|---|",
        ]
        for p in r["points"]:
            lines.append(
                f"| {p['temperature']:g} | {p['weight_decay']:g} | {p[f'recall@{k}']:.4f} | "
                f"{p[f'ndcg@{k}']:.4f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0, load = time.perf_counter(), os.getloadavg()
    results = [sweep(name, args) for name in args.datasets.split(",")]
    report = markdown(results, args.k)
    print(report)
    meta = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": time.perf_counter() - t0,
        "loadavg_start": load,
        "loadavg_end": os.getloadavg(),
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, {"meta": meta, "results": results, "markdown": report}, indent=1)


if __name__ == "__main__":
    main()
