"""Eviction cost of the id map (``sharded_tables/csrc/idmap.cpp``): one insert batch of new keys
into a full map, per policy.

LRU pops its victims from an access queue (O(victims) a batch); hybrid takes them from its order of
zero-count slots (O(victims log capacity) while there are enough of them); LFU ranks every
untouched slot (O(capacity) a batch). The hot-row caches of remote tables and the working tables
of hashed training evict on every batch that brings new ids.

``--zipf ROWS``: instead, a hot-row cache's stream: batches of Zipf(1.1) ids over ROWS rows
(``bench/zipf_ids.py``) inserted into a map of ``--capacity`` slots, the median insert over the
batches after a warm-up (hits are touched, misses evict): counts then vary as in a real cache.

Run from the repository root::

    .venv/bin/python bench/idmap.py [--capacity 1000000] [--batch 256]
    .venv/bin/python bench/idmap.py --zipf 1000000 --capacity 100000 --batch 2560
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from zipf_ids import ZipfIds

from sharded_tables.idmap import IdMap


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--capacity", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=256, help="new keys per insert")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--zipf", type=int, default=0, help="rows of a Zipf(1.1) id stream (0: off)")
    p.add_argument("--warmup", type=int, default=300, help="--zipf: batches before timing")
    args = p.parse_args()
    if args.zipf:
        zipf_stream(args)
        return
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


def zipf_stream(args: argparse.Namespace) -> None:
    ids, rng = ZipfIds(args.zipf, 1.1), np.random.default_rng(0)
    batches = [ids.draw((args.batch,), rng).unique() for _ in range(args.warmup + args.repeats)]
    print(
        f"| policy | insert of a Zipf(1.1) batch ({args.batch} ids over {args.zipf:,} rows) into "
        f"{args.capacity:,} slots (median) | new keys a batch |"
    )
    print("|---|---|---|")
    for policy in ("lru", "lfu", "hybrid"):
        m = IdMap(args.capacity, policy)
        times, new = [], []
        for i, keys in enumerate(batches):
            t0 = time.perf_counter()
            out = m.insert_detailed(keys)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                new.append(len(out.new_keys))
        ms = statistics.median(times) * 1e3
        print(f"| {policy} | {ms:.3f} ms | {statistics.median(new):.0f} |")


if __name__ == "__main__":
    main()
