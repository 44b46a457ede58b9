"""In-process A/B of ``IVFIndex.search`` between two checkouts, timed in turns.

Each checkout gets a worker process (``PYTHONPATH`` = that tree, so its ``retrieval`` is the one
imported) that builds the same seeded index (``ann_data.make_data``'s clustered vectors with the
``ann.py`` filter attributes; costs not measured, so both plan alike) and then times the cases it
is asked for. The driver asks A and B in turns, swapping which goes first each round (AB BA AB
...), so a slow minute on a shared machine lands on both; each round gives one B ÷ A ratio of
medians per case, and the table reports their median and range (> 1: B is slower). Before
timing, each worker answers every query of every case once and the driver checks that A and B
return the same ids.

Cases: ``one`` times queries one at a time (the median call), ``batch`` one call of all
``--queries`` (the median of ``--repeats`` calls); each unfiltered and under each ``--filters``
label (a compiled filter, outside timing, as ``ann.py`` passes them).

Run from the repository root::

    .venv/bin/python bench/turns.py /work/wt/base .             # base checkout vs this tree
    .venv/bin/python bench/turns.py A B --n 20000 --nlist 128 --rounds 9
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("a", nargs="?", help="checkout A (the baseline): a repository root")
    p.add_argument("b", nargs="?", help="checkout B (measured against A)")
    p.add_argument("--n", type=int, default=100_000, help="items (ann.py --small's)")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=1)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--queries", type=int, default=1000, help="queries (the batch's rows)")
    p.add_argument("--filters", default="10%", help="ann_data.FILTERS labels, comma-separated")
    p.add_argument(
        "--exact-cost",
        type=float,
        default=2.0,
        help="IVFConfig.exact_cost (costs are not measured): small sends a filtered row to the "
        "exact scan of its eligible items, e.g. 0.1 for 10%% at 100k",
    )
    p.add_argument(
        "--filter-bound", type=float, default=0.9, help="IVFConfig.filter_bound (0: no bound check)"
    )
    p.add_argument("--calls", type=int, default=2000, help="one-query calls timed a round")
    p.add_argument("--repeats", type=int, default=5, help="batched calls timed a round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1, help="torch threads in each worker")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="see CLOCKS")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker and (args.a is None or args.b is None):
        p.error("give checkouts A and B")
    return args


# ---- worker: one checkout's index, timed on request ----------------------------------------
def build_cases(args: argparse.Namespace) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """The index of this checkout and the cases: name -> ``(queries, filter)``, where queries
    are one tensor (batched) or a list of ``[1, D]`` rows (one at a time)."""
    import torch
    from ann_data import FILTERS, make_data

    from retrieval.index import IVFConfig, build_ivf

    torch.set_num_threads(args.threads)
    data = make_data(args.n, args.d, args.queries)
    cfg = IVFConfig(
        nlist=args.nlist,
        nprobe=args.nprobe,
        rerank=0,
        codes="int8",
        exact_copy="none",
        measure_costs=False,
        exact_cost=args.exact_cost,
        filter_bound=args.filter_bound,
    )
    attrs = {name: np.asarray(v, dtype=np.int64) for name, v in data.attributes.items()}
    x = torch.from_numpy(data.x)
    index = build_ivf(x, cfg, item_attributes=attrs, attribute_values=data.attribute_values)
    index.eval()
    q = torch.from_numpy(data.q)
    rows = [q[i : i + 1] for i in range(len(q))]
    cases: dict[str, tuple[Any, Any]] = {"one none": (rows, None), "batch none": (q, None)}
    for label in filter(None, args.filters.split(",")):
        text = FILTERS[label].expression()
        cases[f"one {label}"] = (rows, index.compile_filter(text, 1))
        cases[f"batch {label}"] = (q, index.compile_filter(text, len(q)))
    return index, cases


def answers(index: Any, queries: Any, fb: Any, args: argparse.Namespace) -> str:
    """A digest of the ids the case returns for every query."""
    h = hashlib.sha1()
    for q in queries if isinstance(queries, list) else [queries]:
        ids, _ = index.search(q, args.k, fb, nprobe=args.nprobe)
        h.update(ids.numpy().tobytes())
    return h.hexdigest()


def describe(index: Any, queries: Any, fb: Any, args: argparse.Namespace) -> str:
    """What the plan does with the case's first row: an exact scan, or how many lists."""
    b = 1 if isinstance(queries, list) else len(queries)
    plan = index.search_plan(args.k, fb, batch=b, nprobe=args.nprobe)
    return "exact" if bool(plan.exact[0]) else f"{int(plan.nprobe[0])} lists"


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
"""``--clock``: wall time, or this thread's CPU time (blind to the time a busy machine's
scheduler takes the worker off its core, which on a shared machine is most of the noise; with
``--threads 1`` the search runs on this thread)."""
BLOCK = 50
"""One-query calls timed together: a CPU clock costs a system call, too much to read per call."""


def time_case(index: Any, queries: Any, fb: Any, args: argparse.Namespace) -> float:
    """Median microseconds of one call: of one query (per call, over blocks of :data:`BLOCK`
    calls), or of the whole batch."""
    search, k, nprobe, clock = index.search, args.k, args.nprobe, CLOCKS[args.clock]
    if isinstance(queries, list):
        for q in queries[:BLOCK]:
            search(q, k, fb, nprobe=nprobe)
        blocks = []
        for start in range(0, args.calls, BLOCK):
            block = [queries[i % len(queries)] for i in range(start, start + BLOCK)]
            t0 = clock()
            for q in block:
                search(q, k, fb, nprobe=nprobe)
            blocks.append((clock() - t0) / BLOCK)
        return statistics.median(blocks) / 1e3
    search(queries, k, fb, nprobe=nprobe)
    runs = []
    for _ in range(args.repeats):
        t0 = clock()
        search(queries, k, fb, nprobe=nprobe)
        runs.append(clock() - t0)
    return statistics.median(runs) / 1e3


def worker(args: argparse.Namespace) -> None:
    """Builds, answers the digests, then times a case per line of stdin (its name)."""
    index, cases = build_cases(args)
    digests = {name: answers(index, qs, fb, args) for name, (qs, fb) in cases.items()}
    plans = {name: describe(index, qs, fb, args) for name, (qs, fb) in cases.items()}
    print(json.dumps({"digests": digests, "plans": plans}), flush=True)
    for line in sys.stdin:
        qs, fb = cases[line.strip()]
        print(json.dumps({"us": time_case(index, qs, fb, args)}), flush=True)


# ---- driver: two workers in turns --------------------------------------------------------------
class Worker:
    """One checkout's worker process, asked one case at a time."""

    def __init__(self, tree: str, argv: list[str]) -> None:
        root = str(Path(tree).resolve())
        env = {**os.environ, "PYTHONPATH": root}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", *argv],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.proc.wait()})")
        return json.loads(line)

    def time(self, case: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(case + "\n")
        self.proc.stdin.flush()
        return float(self.read()["us"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def worker_argv(args: argparse.Namespace) -> list[str]:
    names = ("n", "d", "nlist", "nprobe", "k", "queries", "filters", "exact_cost", "filter_bound")
    names += ("calls", "repeats", "threads", "clock")
    return [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in names]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    a, b = Worker(args.a, worker_argv(args)), Worker(args.b, worker_argv(args))
    try:
        ra, rb = a.read(), b.read()
        da, db = ra["digests"], rb["digests"]
        cases = list(da)
        plans = {
            c: ra["plans"][c]
            + ("" if ra["plans"][c] == rb["plans"].get(c) else " / " + str(rb["plans"].get(c)))
            for c in cases
        }
        same = {c: da[c] == db.get(c) for c in cases}
        ratios: dict[str, list[float]] = {c: [] for c in cases}
        times: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}
        for rnd in range(args.rounds):
            for case in cases:
                if rnd % 2 == 0:
                    ta = a.time(case)
                    tb = b.time(case)
                else:
                    tb = b.time(case)
                    ta = a.time(case)
                times[case].append((ta, tb))
                ratios[case].append(tb / ta)
    finally:
        a.close()
        b.close()
    print(f"A = {args.a}, B = {args.b}; {args.n} x {args.d}, nlist {args.nlist}, nprobe")
    print(f"{args.nprobe}, k {args.k}, int8 codes, no rerank, {args.rounds} rounds in turns,")
    print(f"{args.clock} clock, {args.threads} thread(s)\n")
    print(
        "| case | plan | same ids | A us (median) | B us (median) | B / A (median) | range | rounds |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case in cases:
        r = ratios[case]
        ta = statistics.median(t[0] for t in times[case])
        tb = statistics.median(t[1] for t in times[case])
        each = " ".join(f"{x:.2f}" for x in r)
        print(
            f"| {case} | {plans[case]} | {'yes' if same[case] else 'NO'} | {ta:.1f} | {tb:.1f} | "
            f"{statistics.median(r):.3f} | {min(r):.2f}-{max(r):.2f} | {each} |"
        )


if __name__ == "__main__":
    main()
