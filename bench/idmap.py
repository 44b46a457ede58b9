"""Eviction cost of the id map (``sharded_tables/csrc/idmap.cpp``): one insert batch of new keys
into a full map, per policy.

LRU pops its victims from an access queue (O(victims) a batch); LFU and hybrid rank every
untouched slot (O(capacity) a batch). The hot-row caches of remote tables and the working tables
of hashed training evict on every batch that brings new ids.

Run from the repository root::

    .venv/bin/python bench/idmap.py [--capacity 1000000] [--batch 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sharded_tables.idmap import IdMap


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--capacity", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=256, help="new keys per insert")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    print(
        f"| policy | insert of {args.batch} new keys into a full map of {args.capacity:,} (median) |"
    )
    print("|---|---|")
    for policy in ("lru", "lfu", "hybrid"):
        m = IdMap(args.capacity, policy)
        m.insert(torch.arange(args.capacity))
        key, times = 1 << 40, []
        for _ in range(args.repeats):
            keys = torch.arange(key, key + args.batch)
            key += args.batch
            t0 = time.perf_counter()
            m.insert(keys)
            times.append(time.perf_counter() - t0)
        print(f"| {policy} | {statistics.median(times) * 1e3:.3f} ms |")


if __name__ == "__main__":
    main()
