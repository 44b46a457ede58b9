"""The planner's estimate of a whole filter expression (``retrieval/index/selectivity.py``) and what
it buys: filters whose clauses rarely meet, at about 50 / 5 / 0.5 / 0.05 % of the catalog.

Each expression ANDs clauses on attributes that are anti-correlated (``a_i = x`` and ``b_i = x``
each hold on half the items, on the same item only for ``overlap_i`` of them), so the clauses'
product, the estimate of independent clauses, reads ~25 % whatever the truth. For each: the
truth, the sampled estimate and the independent one, and per estimate the plan it chose (rows by
kind), recall@K against the exact filtered top-K and q/s, the filter shared by a batch of
queries. "as before" is the same index planning from the independent estimate alone (its sample
left out): the planner before the sample. Vectors: the ANN benchmark's clustered data
(``bench/ann_data.py``), the attributes independent of them. Both estimates run in one process,
in turns, on the same index.

Run from the repository root::

    .venv/bin/python bench/selectivity.py --small   # 20k x 32, ~20 s
    .venv/bin/python bench/selectivity.py           # 200k x 64, nlist 1024 (~2 min)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ann_data import exact_topk, make_data, recall_at_k
from timing import set_threads, stopwatch

from common.atomic import atomic_write_json
from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf, planner
from retrieval.index.executor import Executor
from retrieval.index.plan import RowKind
from retrieval.index.selectivity import estimate
from retrieval.index.tensors import FilterSample

OVERLAPS = (0.1, 0.01, 0.001)
"""``overlap_i`` of the pairs ``(a_i, b_i)``: ``a_i = x and b_i = x`` admits half of it."""

EXPRESSIONS = (
    ("~50 %", "a0 = x and (b0 = y or language != de)"),
    ("~5 %", "a0 = x and b0 = x"),
    ("~0.5 %", "a1 = x and b1 = x and language != de"),
    ("~0.05 %", "a2 = x and b2 = x"),
)
VALUES: dict[str, Any] = {
    **{f"{p}{i}": ["x", "y"] for i in range(len(OVERLAPS)) for p in "ab"},
    "language": ["en", "fr", "de", "es"],
}


def attributes(n: int, seed: int = 11) -> dict[str, np.ndarray]:
    """The anti-correlated pairs and an independent language, codes ``[N]``."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {"language": rng.integers(0, 4, n)}
    for i, overlap in enumerate(OVERLAPS):
        a = rng.integers(0, 2, n)
        out[f"a{i}"], out[f"b{i}"] = a, np.where(rng.random(n) < overlap, a, 1 - a)
    return out


def admitted(a: dict[str, np.ndarray], text: str) -> np.ndarray:
    """The items ``text`` admits, from the columns (NumPy): the ground truth's eligible ids."""
    x = {name: col == 0 for name, col in a.items() if name != "language"}
    de = a["language"] == 2
    rules = {
        EXPRESSIONS[0][1]: x["a0"] & (~x["b0"] | ~de),
        EXPRESSIONS[1][1]: x["a0"] & x["b0"],
        EXPRESSIONS[2][1]: x["a1"] & x["b1"] & ~de,
        EXPRESSIONS[3][1]: x["a2"] & x["b2"],
    }
    return np.flatnonzero(rules[text])


def independent(
    sample: FilterSample, counts: torch.Tensor, num_items: int, fb: FilterBatch
) -> torch.Tensor:
    """The planner's estimate before the sample: :func:`estimate` with none."""
    return estimate(replace(sample, host=sample.host[:0]), counts, num_items, fb)


def planning_as_before(index: IVFIndex, before: bool) -> None:
    """The planner estimates as before the sample (``before``: :func:`independent`, swapped in
    for the bench) or as built, on a fresh executor (its kept plans hold the estimate's)."""
    planner.estimate = independent if before else estimate
    index.executor = Executor(index.executor.backend)


def measure(index: IVFIndex, q: torch.Tensor, k: int, text: str, truth: np.ndarray, rounds: int):
    """``{before: {recall, qps, kinds, estimate}}`` for both estimates, timed in turns."""
    out: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[float]] = {"sampled": [], "as before": []}
    for _ in range(rounds):
        for name in runs:
            planning_as_before(index, name == "as before")
            index.search(q, k, text)  # warm: the plan and the scan's buffers
            elapsed = stopwatch()
            ids, _ = index.search(q, k, text)
            runs[name].append(elapsed())
            if name not in out:
                t = index.tensors()
                fb = index.compile_filter(text, len(q))
                plan = index.plan(fb, index.params(k), q)
                kinds = np.unique(plan.kind.numpy(), return_counts=True)
                out[name] = {
                    "recall": recall_at_k(ids.numpy(), truth),
                    "estimate": float(
                        planner.estimate(t.filter_sample, t.bit_counts, t.ntotal, fb)[0]
                    ),
                    "kinds": {RowKind(int(a)).name: int(c) for a, c in zip(*kinds, strict=True)},
                    "mean_lists": float(plan.nprobe.double().mean()),
                }
    planning_as_before(index, False)
    for name, r in runs.items():
        out[name]["qps"] = len(q) / float(np.median(r))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = make_data(args.n, args.d, args.queries)
    a = attributes(args.n)
    elapsed = stopwatch()
    index = build_ivf(
        torch.from_numpy(data.x),
        IVFConfig(nlist=args.nlist),
        item_attributes=a,
        attribute_values=VALUES,
    )
    build_s = elapsed()
    q = torch.from_numpy(data.q)
    cases = []
    for label, text in EXPRESSIONS:
        keep = admitted(a, text)
        truth = exact_topk(data.x, data.q, args.k, keep)
        m = measure(index, q, args.k, text, truth, args.rounds)
        cases.append({"label": label, "text": text, "truth": len(keep) / args.n, **m})
        print(f"{label}: truth {len(keep) / args.n:.4%}, {m}", file=sys.stderr)
    return {
        "items": args.n, "dim": args.d, "nlist": args.nlist, "k": args.k,
        "queries": args.queries, "nprobe": index.config.nprobe, "build_s": build_s,
        "cases": cases,
    }  # fmt: skip


def render(r: dict[str, Any]) -> str:
    head = (
        "| expression | truth | estimate: sampled / as before | plan: sampled / as before "
        "| recall@K: sampled / as before | q/s: sampled / as before |\n|---|---|---|---|---|---|"
    )
    rows = []
    for c in r["cases"]:
        s, b = c["sampled"], c["as before"]

        def plan(p: dict[str, Any]) -> str:
            kinds = ", ".join(f"{k} {v}" for k, v in p["kinds"].items())
            return f"{kinds} ({p['mean_lists']:.0f} lists)"

        rows.append(
            f"| `{c['text']}` | {c['truth']:.3%} | {s['estimate']:.3%} / {b['estimate']:.3%} "
            f"| {plan(s)} / {plan(b)} | {s['recall']:.3f} / {b['recall']:.3f} "
            f"| {s['qps']:,.0f} / {b['qps']:,.0f} |"
        )
    return "\n".join([head, *rows])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=200_000, help="items (default 200,000)")
    p.add_argument("--d", type=int, default=64, help="dimensions (default 64)")
    p.add_argument("--nlist", type=int, default=1024, help="lists (default 1024)")
    p.add_argument("--queries", type=int, default=200, help="queries, one batch (default 200)")
    p.add_argument("--k", type=int, default=100, help="top-K (default 100)")
    p.add_argument("--rounds", type=int, default=5, help="timed turns of each estimate")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--small", action="store_true", help="20k x 32, nlist 128: a smoke run")
    p.add_argument("--out", type=Path, default=Path("bench/results/selectivity.json"))
    args = p.parse_args(argv)
    if args.small:
        args.n, args.d, args.nlist = 20_000, 32, 128
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    wall, load_start = stopwatch(), os.getloadavg()
    r = run(args)
    report = render(r)
    print(report)
    meta = {
        "argv": sys.argv[1:] if argv is None else argv,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "wall_s": wall(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    atomic_write_json(args.out, {"meta": meta, "result": r, "markdown": report}, indent=1)
    print(f"\nwrote {args.out} in {wall():.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
