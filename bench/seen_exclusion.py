"""Seen items excluded inside the scan vs a widened candidate budget (issue 19), same run.

A request that names S seen items needs K results the user has not seen. Two ways:

* ``in scan`` (ours since 2026-11-26): ``FilterBatch.exclude`` carries the ids; the index maps
  them to its rows once and blanks them while it scans (``retrieval/index/exclude.py``), keeping
  the best K;
* ``budget`` (ours before, and what a plain ANN library forces): search ``K + S`` candidates,
  strike the seen ones, keep the best K.

Both probe the same lists (the plan holds room for ``K + S`` either way), so they return the same
items; the table shows time per query and that equality. Data: clustered vectors as
``bench/ann_data.py``; each query's seen list is half its own best items, half random ones.

Run from the repository root::

    .venv/bin/python bench/seen_exclusion.py --small      # ~20 s
    .venv/bin/python bench/seen_exclusion.py              # 200k x 64, nlist 1024
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
from ann_data import make_data
from timing import set_threads, stopwatch, time_batched

from common.atomic import atomic_write_json
from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.exclude import excluded_positions, is_excluded


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="20k x 32, nlist 128")
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=32)
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--seen", default="0,100,1000,10000", help="seen-list lengths S")
    p.add_argument("--batches", default="1,64", help="queries per call")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench/results/seen_exclusion.json"))
    args = p.parse_args(argv)
    if args.small:
        args.n, args.d, args.nlist, args.nprobe, args.queries = 20_000, 32, 128, 8, 64
        args.seen = "0,100,1000"
    return args


def seen_lists(index: IVFIndex, q: torch.Tensor, s: int, k: int) -> torch.Tensor:
    """``[B, S]`` ids: every other one of each query's best ``2k`` items, then random ones."""
    if s == 0:
        return torch.zeros(q.shape[0], 0, dtype=torch.int64)
    best, _ = index.search(q, min(2 * k, index.ntotal))
    own = best[:, ::2][:, : min(k, s)]
    g = torch.Generator().manual_seed(s)
    rand = torch.randint(0, index.ntotal, (q.shape[0], s - own.shape[1]), generator=g)
    return torch.cat([own, rand], dim=1)


def in_scan(index: IVFIndex, q: torch.Tensor, seen: torch.Tensor, k: int, nprobe: int):
    fb = index.schema.empty(q.shape[0])
    fb = FilterBatch(fb.masks, fb.negate, seen if seen.shape[1] else None)
    pos, _ = index.search(q, k, fb, nprobe=nprobe, rerank=0, positions=True)
    return index.item_ids[pos.clamp(min=0)]


def budget(index: IVFIndex, q: torch.Tensor, seen: torch.Tensor, k: int, nprobe: int):
    fb = index.schema.empty(q.shape[0])
    pos, score = index.search(q, k + seen.shape[1], fb, nprobe=nprobe, rerank=0, positions=True)
    if seen.shape[1]:
        score = score.masked_fill(is_excluded(pos, excluded_positions(index.id_order, seen)), -1e30)
    top = score.topk(k, dim=1).indices
    return index.item_ids[pos.gather(1, top).clamp(min=0)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    load_start, wall = os.getloadavg(), stopwatch()
    data = make_data(args.n, args.d, args.queries)
    index = build_ivf(data.x, IVFConfig(nlist=args.nlist, nprobe=args.nprobe))
    q = torch.from_numpy(data.q)
    rows = []
    for s in (int(x) for x in args.seen.split(",")):
        seen = seen_lists(index, q, s, args.k)
        for b in (int(x) for x in args.batches.split(",")):
            chunks = [(q[i : i + b], seen[i : i + b]) for i in range(0, len(q), b)]
            out = {}
            for name, fn in (("in scan", in_scan), ("budget", budget)):

                def run(fn=fn, chunks=chunks) -> torch.Tensor:
                    return torch.cat([fn(index, qq, ss, args.k, args.nprobe) for qq, ss in chunks])

                with torch.inference_mode():
                    ids, median_s, runs = time_batched(run, repeats=args.repeats)
                out[name] = {"us_per_query": 1e6 * median_s / len(q), "runs_s": runs, "ids": ids}
            same = float((out["in scan"]["ids"] == out["budget"]["ids"]).float().mean())
            for v in out.values():
                v.pop("ids")
            rows.append({"seen": s, "batch": b, **out, "same_ids": same})
            print(f"S={s} B={b}: {out} same {same:.4f}", file=sys.stderr)
    head = "| S (seen) | batch | in scan us/query | budget us/query | budget / in scan | same ids |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        a, c = r["in scan"]["us_per_query"], r["budget"]["us_per_query"]
        lines.append(
            f"| {r['seen']} | {r['batch']} | {a:.0f} | {c:.0f} | {c / a:.2f}x | {r['same_ids']:.4f} |"
        )
    report = "\n".join(lines)
    print(report)
    meta = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "wall_s": wall(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, {"meta": meta, "rows": rows, "markdown": report}, indent=1)
    print(f"\nwrote {args.out} in {wall():.0f} s", file=sys.stderr)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
