"""Filtered search where the filter is anti-correlated with the query (issue 19): recall@K and
q/s per selectivity for our plan without the bound check (``filter_bound = 0``, the old rule),
with it (the default: slack measured at build), with the provable bound (slack 1), and faiss
``IVF{nlist},SQ8`` with an ``IDSelectorBitmap`` as the peer.

Data (``retrieval/data/anticorrelated.py``): clustered vectors; each query's eligible items come
from clusters outside its neighbourhood. ``--data independent`` runs the ANN benchmark's data
and filters instead (attributes independent of the vectors: the check must not cost there).

Queries go in groups that share a filter (one home each; one group for ``independent``): faiss
takes one selector per call, so both systems are called once per group, filters compiled (and
bitmaps packed) outside timing. faiss sweeps nprobe 1, 2, 4, ...; the table shows it at the
first power of two >= the lists our plan probed (work matched) and at the cheapest setting
reaching ``--target``. "lists" is the mean number of lists our plan probed per query (both
rounds; rows scanned exactly count none: "exact" is their share).

Run from the repository root::

    .venv/bin/python bench/filtered.py --small               # ~1 min: 20k x 32, for a smoke run
    .venv/bin/python bench/filtered.py                       # 200k x 64, nlist 1024
    .venv/bin/python bench/filtered.py --data independent --out bench/results/filtered_independent.json
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from ann_data import FILTERS, exact_topk, make_data, recall_at_k
from ann_peers import bitmap_selector, build_faiss_ivfs, faiss_search, ivf_params
from timing import set_threads, stopwatch, time_batched

from common.atomic import atomic_write_json
from retrieval.data.anticorrelated import SELECTIVITIES, anticorrelated
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.plan import SearchPlan
from retrieval.index.search import Candidates, run_search
from retrieval.index.stats import IndexStats

VARIANTS: dict[str, dict[str, Any]] = {
    "old": {"filter_bound": 0.0},
    "new": {},
    "provable": {"filter_bound_slack": 1.0},
}


@dataclass
class Group:
    """Query rows sharing one filter: ``rows [b]``, ``keep [N] bool``, its text, ground truth."""

    rows: np.ndarray
    keep: np.ndarray
    text: str | None
    truth: np.ndarray


@dataclass
class Case:
    label: str
    selectivity: float  # measured: mean share of items the groups' filters keep
    groups: list[Group]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", choices=["anticorrelated", "independent"], default="anticorrelated")
    p.add_argument("--small", action="store_true", help="20k x 32, nlist 128, 200 centres")
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--centres", type=int, default=1000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--homes", type=int, default=20, help="query groups (one filter each)")
    p.add_argument("--neighbourhood", type=float, default=0.05)
    p.add_argument(
        "--nprobe", type=int, default=0, help="0: tuned for unfiltered recall 0.95 (on queries)"
    )
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--recall-targets",
        type=lambda s: [float(x) for x in s.split(",") if x],
        default=[0.9, 0.95, 0.99],
        help="per-request recall targets to run (retrieval/index/targets.py), comma-separated",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/filtered.json"))
    args = p.parse_args(argv)
    if args.small:
        args.n, args.d, args.nlist, args.centres, args.queries = 20_000, 32, 128, 200, 200
    return args


def make_cases(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, list[Case], dict]:
    """-> items ``[N, D]``, queries ``[B, D]``, the cases (unfiltered first), attributes and
    ``tune``: queries the build tunes on, drawn like the run's (every home) but not them."""
    values: dict[str, Any]
    if args.data == "independent":
        ann = make_data(args.n, args.d, args.queries)
        x, q, attrs, values = ann.x, ann.q, ann.attributes, ann.attribute_values
        tune = q[::4]  # i.i.d. queries: a quarter of them stand for the rest
        specs = [
            (f.label, [(np.arange(len(q)), f.mask(attrs), f.expression())])
            for f in FILTERS.values()
        ]
    else:
        data = anticorrelated(
            args.n, args.d, args.queries, n_centres=args.centres, homes=args.homes,
            neighbourhood=args.neighbourhood,
        )  # fmt: skip
        x, q, attrs, values = data.x, data.q, data.attributes, data.attribute_values
        rng = np.random.default_rng(1)  # fresh queries around the same homes
        homes = data.centres[data.home[::2]]
        tune = (homes + rng.standard_normal(homes.shape, dtype=np.float32)).astype(np.float32)
        specs = []
        for s in SELECTIVITIES:
            groups = []
            for h in np.unique(data.home):
                clusters = data.eligible_clusters(int(h), s)
                text = "cluster in {" + ",".join(map(str, clusters)) + "}"
                groups.append((np.flatnonzero(data.home == h), data.keep(int(h), s), text))
            specs.append((f"{100 * s:g}%", groups))
    cases = [
        Case(
            "none",
            1.0,
            [Group(np.arange(len(q)), np.ones(len(x), bool), None, exact_topk(x, q, args.k))],
        )
    ]
    for label, groups in specs:
        gs = [
            Group(rows, keep, text, exact_topk(x, q[rows], args.k, np.flatnonzero(keep)))
            for rows, keep, text in groups
        ]
        cases.append(Case(label, float(np.mean([g.keep.mean() for g in gs])), gs))
    return x, q, cases, {"attributes": attrs, "values": values, "tune": tune}


def probe_counts(
    index: IVFIndex, q: torch.Tensor, fb, k: int, target: float | None = None
) -> tuple[float, float]:
    """(mean lists probed per row over both rounds, share of rows scanned exactly), untimed."""
    t = None if target is None else torch.full((q.shape[0],), target)
    plan = index.plan(fb, index.params(k, rerank=0, target=t), q=q)
    lists = torch.zeros(q.shape[0])
    exact = plan.exact.clone()

    def fetch(p: SearchPlan, rows: torch.Tensor | None) -> Candidates:
        r = torch.arange(q.shape[0]) if rows is None else rows
        if p.lists is None:
            lists[r] += torch.where(p.exact, 0, p.nprobe).float()
        else:
            lists[r] += torch.where(p.exact, 0, (p.lists >= 0).sum(dim=1)).float()
        exact[r] |= p.exact
        f = fb if rows is None else fb.rows(rows)
        return index.item_candidates(q[r], f, p)

    run_search(plan, fetch)
    lists = torch.where(exact, 0.0, lists)
    return float(lists.mean()), float(exact.float().mean())


def run_ours(index: IVFIndex, q: np.ndarray, case: Case, args) -> dict:
    qt = torch.from_numpy(q)
    out = {}
    runs = [(name, changes, None) for name, changes in VARIANTS.items()]
    runs += [(f"target {t:g}", {}, t) for t in args.recall_targets]
    for name, changes, target in runs:
        saved, measured = index.config, index.stats
        index.config = saved.model_copy(
            update={k: v for k, v in changes.items() if k not in IndexStats.model_fields}
        )
        index.stats = measured.model_copy(
            update={k: v for k, v in changes.items() if k in IndexStats.model_fields}
        )
        calls = [
            (
                torch.from_numpy(g.rows),
                index.compile_filter(g.text, len(g.rows)) if g.text else None,
            )
            for g in case.groups
        ]

        def search(calls=calls, target=target) -> np.ndarray:
            ids = np.full((len(q), args.k), -1, dtype=np.int64)
            for rows, fb in calls:
                found = index.search(qt[rows], args.k, fb, recall_target=target)[0]
                ids[rows.numpy()] = found.numpy()
            return ids

        with torch.inference_mode():
            ids, median_s, runs = time_batched(search, repeats=args.repeats)
            counts = [
                probe_counts(index, qt[r], fb, args.k, target) for r, fb in calls if fb is not None
            ]
        index.config, index.stats = saved, measured
        lists, exact = (
            (np.mean([c[0] for c in counts]), np.mean([c[1] for c in counts]))
            if counts
            else (float(index.config.nprobe), 0.0)
        )
        out[name] = {
            "recall": recall_at_k(ids, truth_of(case, len(q), args.k)),
            "qps": len(q) / median_s,
            "runs_s": runs,
            "lists": lists,
            "exact_rows": exact,
        }
    return out


def truth_of(case: Case, b: int, k: int) -> np.ndarray:
    out = np.full((b, k), -1, dtype=np.int64)
    for g in case.groups:
        out[g.rows] = g.truth
    return out


def run_faiss(ivf: faiss.Index, q: np.ndarray, case: Case, args, lists: float) -> list[dict]:
    """nprobe 1, 2, 4, ... until recall reaches ``--target`` and nprobe our ``lists`` (or nlist)."""
    sels = [None if g.text is None else bitmap_selector(g.keep) for g in case.groups]
    points, nprobe = [], 1
    while True:
        params = [ivf_params(nprobe, s) for s in sels]

        def search(params=params) -> np.ndarray:
            ids = np.full((len(q), args.k), -1, dtype=np.int64)
            for g, p in zip(case.groups, params, strict=True):
                ids[g.rows] = faiss_search(ivf, q[g.rows], args.k, p)
            return ids

        ids, median_s, runs = time_batched(search, repeats=args.repeats)
        rec = recall_at_k(ids, truth_of(case, len(q), args.k))
        points.append({"nprobe": nprobe, "recall": rec, "qps": len(q) / median_s, "runs_s": runs})
        if (rec >= args.target and nprobe >= lists) or nprobe >= args.nlist:
            return points
        nprobe = min(2 * nprobe, args.nlist)


def render(results: list[dict], target: float) -> str:
    head = (
        "| filter | selectivity | old recall | old q/s | new recall | new q/s | new lists | "
        "new exact | provable recall | provable q/s | faiss SQ8 at our lists: recall (nprobe) | "
        f"q/s | faiss SQ8 cheapest >= {target}: recall (nprobe) | q/s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        o, f = r["ours"], r["faiss"]
        at = next((p for p in f if p["nprobe"] >= max(o["new"]["lists"], 1)), f[-1])
        ok = next((p for p in f if p["recall"] >= target), None)
        cheap = f"{ok['recall']:.3f} ({ok['nprobe']})" if ok else f"< {target}"
        lines.append(
            f"| {r['label']} | {100 * r['selectivity']:.2f}% | {o['old']['recall']:.3f} | "
            f"{o['old']['qps']:.0f} | {o['new']['recall']:.3f} | {o['new']['qps']:.0f} | "
            f"{o['new']['lists']:.0f} | {o['new']['exact_rows']:.2f} | "
            f"{o['provable']['recall']:.3f} | {o['provable']['qps']:.0f} | "
            f"{at['recall']:.3f} ({at['nprobe']}) | {at['qps']:.0f} | {cheap} | "
            f"{ok['qps'] if ok else float('nan'):.0f} |"
        )
    return "\n".join(lines)


def render_targets(results: list[dict], targets: list[float]) -> str:
    """Per-request recall targets: recall and q/s at each, per filter."""
    head = "| filter | selectivity | " + " | ".join(f"target {t:g}: recall | q/s" for t in targets)
    lines = [head + " |", "|" + "---|" * (2 + 2 * len(targets))]
    for r in results:
        cells = []
        for t in targets:
            o = r["ours"][f"target {t:g}"]
            cells.append(f"{o['recall']:.3f} | {o['qps']:.0f}")
        lines.append(
            f"| {r['label']} | {100 * r['selectivity']:.2f}% | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()
    set_threads(args.threads)
    wall = stopwatch()
    x, q, cases, attrs = make_cases(args)
    cfg = IVFConfig(
        nlist=args.nlist, nprobe=max(args.nprobe, 1), target_recall=0.0 if args.nprobe else 0.95
    )
    elapsed = stopwatch()
    index = build_ivf(
        x,
        cfg,
        item_attributes=attrs["attributes"],
        attribute_values=attrs["values"],
        tune_queries=attrs[
            "tune"
        ],  # nprobe tuned (and the slack measured) on queries like the run's
    )
    build_s = elapsed()
    elapsed = stopwatch()
    sq8 = build_faiss_ivfs(x, args.nlist, min(args.n, 256 * args.nlist))[0]["faiss-IVF-SQ8"].index
    faiss_build_s = elapsed()
    nprobe = index.config.nprobe
    results = []
    for case in cases:
        print(f"{case.label} ...", file=sys.stderr)
        ours = run_ours(index, q, case, args)
        faiss_points = run_faiss(sq8, q, case, args, ours["new"]["lists"])
        results.append(
            {
                "label": case.label,
                "selectivity": case.selectivity,
                "ours": ours,
                "faiss": faiss_points,
            }
        )
    report = render(results, args.target) + "\n\n" + render_targets(results, args.recall_targets)
    print(report)
    meta = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "nprobe": nprobe,
        "slack": index.stats.filter_bound_slack,
        "filter_bound": index.config.filter_bound,
        "build_s": build_s,
        "faiss_build_s": faiss_build_s,
        "cores": os.cpu_count(),
        "faiss": faiss.__version__,
        "torch": torch.__version__,
        "wall_s": wall(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, {"meta": meta, "results": results, "markdown": report}, indent=1)
    print(
        f"\nwrote {args.out} in {wall():.0f} s (load {load_start} -> {os.getloadavg()})",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
