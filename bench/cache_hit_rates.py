"""Hit rates of a remote table's hot-row cache by size, at Zipf(1.1) ids (issue 17): what the
planner's default ``cache_fraction`` should be.

For each table size (``--rows``) and cache size (``--fractions`` of the rows), a
``TieredEmbeddingCollection`` with the table remote (the serving default policy: decayed LFU,
admission on a second sighting) reads a stream of requests of ``--users`` users x ``--ids`` ids,
truncated Zipf(``--s``) (``bench/zipf_ids.py``), from an in-process fetcher: ``--warm-ids`` ids
first (the cache fills), then the hit rate (per id) over ``--ids-measured`` more. Beside it, the
ideal: the share of draws that fall on the ``cache_rows`` hottest rows (a static cache that knows
the law). No server: the cache, not the network, decides the hit rate.

Run from the repository root::

    .venv/bin/python bench/cache_hit_rates.py --out bench/results/cache_hit_rates.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import int_list
from zipf_ids import ZipfIds

from sharded_tables.planner import Budgets, PlacementPlan, TablePlacement
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.tiered import TieredEmbeddingCollection


class PackedRows:
    """The table's packed rows in this process (``RemoteFetcher``)."""

    def __init__(self, packed: torch.Tensor, name: str):
        self.packed, self.name = packed, name

    def fetch(self, ids_by_table, timeout=None):
        return {t: self.packed[ids] for t, ids in ids_by_table.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int_list, default=[100_000, 1_000_000])
    p.add_argument("--fractions", default="0.01,0.02,0.05,0.1,0.2")
    p.add_argument("--s", type=float, default=1.1, help="Zipf exponent")
    p.add_argument("--users", type=int, default=8, help="users per request")
    p.add_argument("--ids", type=int, default=10, help="ids of the table per user")
    p.add_argument("--warm-ids", type=int, default=1_000_000)
    p.add_argument("--ids-measured", type=int, default=400_000)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def hit_rate(rows: int, cache_rows: int, args: argparse.Namespace, zipf: ZipfIds) -> float:
    spec = TableSpec("t", rows, 8, DType.INT8, features=("t",))
    placement = TablePlacement(
        "t", Tier.REMOTE, DType.INT8, spec.bytes(), servers=(0,), partition="range",
        row_bounds=(0, rows), cache_rows=cache_rows,
    )  # fmt: skip
    big = 1 << 40
    budgets = Budgets(device=0, host=0, remote_per_server=big, remote_servers=1, cache=big)
    coll = TieredEmbeddingCollection([spec], PlacementPlan((placement,), budgets))
    coll.remote = PackedRows(torch.zeros(rows, spec.row_bytes(), dtype=torch.uint8), "t")
    rng = np.random.default_rng(0)
    per_call = args.users * args.ids
    with torch.inference_mode():
        for _ in range(args.warm_ids // per_call):
            coll({"t": zipf.draw((args.users, args.ids), rng)})
        before = coll.cache_stats()["t"]
        for _ in range(args.ids_measured // per_call):
            coll({"t": zipf.draw((args.users, args.ids), rng)})
        after = coll.cache_stats()["t"]
    hits = after["hits"] - before["hits"]
    return hits / (hits + after["misses"] - before["misses"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    fractions = [float(x) for x in args.fractions.split(",") if x]
    results: dict = {"argv": sys.argv[1:], "s": args.s, "cases": []}
    print("| rows | cache (share of rows) | hit rate | ideal (hottest rows) |")
    print("|---|---|---|---|")
    for rows in args.rows:
        zipf = ZipfIds(rows, args.s)
        for f in fractions:
            cache_rows = int(rows * f)
            t0 = time.perf_counter()
            rate = hit_rate(rows, cache_rows, args, zipf)
            ideal = zipf.top_share(cache_rows)
            results["cases"].append({
                "rows": rows, "fraction": f, "cache_rows": cache_rows, "hit_rate": rate,
                "ideal": ideal, "seconds": time.perf_counter() - t0,
            })  # fmt: skip
            print(f"| {rows:,} | {f:g} ({cache_rows:,}) | {rate:.3f} | {ideal:.3f} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
