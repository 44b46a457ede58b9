"""Live updates at catalog scale: the fresh segment (ours) against copying the index per update.

In one run, on clustered vectors as ``bench/ann_data.py`` (N x D, IVF):

* **update rates**, batches of ``--batch`` items, in turns: an upsert of new items, an attribute
  flip, a remove, each through the fresh segment (``retrieval/index/live_index.py``) and through
  the copy-on-write rebuild every update paid before (``retrieval/index/update.py``): items/s
  and the ratio;
* **ack to answerable**: one item upserted, then the first search that returns it (median ms);
* **extra memory per batch**: the process's resident memory after ``--mem-batches`` upsert
  batches, less before, per batch (and what the segment's tensors add, per batch);
* **search cost** of a fresh segment of each size in ``--fresh``: batched q/s and one query's
  p50 against the index without one (same turns);
* **recall@100** after upserting ``--upserts`` items and removing as many: the live index, the
  same folded (compaction), and an index rebuilt from scratch, each against the exact top-100.

Run from the repository root::

    .venv/bin/python bench/freshness.py --small    # 100k x 64, ~2 min
    .venv/bin/python bench/freshness.py            # 1M x 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from ann_data import make_data
from timing import set_threads, stopwatch, time_batched, time_single

from common.atomic import atomic_write_json
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index import live_index as live
from retrieval.index import update as copy_update
from retrieval.index.compaction import fold


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="100k x 64, nlist 512")
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--nlist", type=int, default=2048)
    p.add_argument("--nprobe", type=int, default=32)
    p.add_argument("--batch", type=int, default=1000, help="items per update")
    p.add_argument("--turns", type=int, default=3, help="batches of each kind, each path")
    p.add_argument("--mem-batches", type=int, default=50)
    p.add_argument("--fresh", default="1000,10000,50000", help="fresh segment sizes searched")
    p.add_argument("--upserts", type=int, default=50_000)
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/freshness.json"))
    args = p.parse_args(argv)
    if args.small:
        args.n, args.nlist, args.nprobe, args.upserts = 100_000, 512, 16, 10_000
    return args


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _around(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * 3


def update_rates(index: IVFIndex, args: argparse.Namespace) -> list[dict]:
    """Items/s of each kind of update, ours and the copy, in turns (fresh index per kind)."""
    b, w = args.batch, index.sig.shape[1]
    rows = []
    kinds = {
        "upsert": (
            lambda ix, ids, x, s: live.upsert(ix, ids, x, s),
            lambda ix, ids, x, s: copy_update.add_items(ix, ids, x, s),
        ),
        "flip": (
            lambda ix, ids, x, s: live.relabel(ix, ids, s),
            lambda ix, ids, x, s: copy_update.set_signatures(ix, ids, s),
        ),
        "remove": (
            lambda ix, ids, x, s: live.remove(ix, ids),
            lambda ix, ids, x, s: copy_update.remove_items(ix, ids),
        ),
    }
    for kind, (ours, theirs) in kinds.items():
        times: dict[str, list[float]] = {"ours": [], "copy": []}
        state = {"ours": index, "copy": index}
        for turn in range(args.turns):
            if kind == "upsert":
                ids = torch.arange(args.n + turn * b, args.n + (turn + 1) * b)
            else:  # distinct main items each turn
                ids = torch.arange(turn * b, (turn + 1) * b) * 7 % args.n
            x = _around(b, args.d, 100 + turn)
            s = torch.randint(0, 1 << 20, (b, w))
            for name, fn in (("ours", ours), ("copy", theirs)):
                t0 = time.perf_counter()
                state[name] = fn(state[name], ids, x, s)
                times[name].append(time.perf_counter() - t0)
        ours_s, copy_s = statistics.median(times["ours"]), statistics.median(times["copy"])
        rows.append(
            {
                "kind": kind,
                "batch": b,
                "ours_items_per_s": b / ours_s,
                "copy_items_per_s": b / copy_s,
                "ours_ms": 1e3 * ours_s,
                "copy_ms": 1e3 * copy_s,
                "ratio": copy_s / ours_s,
            }
        )
        print(f"{kind}: {rows[-1]}", file=sys.stderr)
    return rows


def ack_to_answer(index: IVFIndex, args: argparse.Namespace, n: int = 20) -> dict:
    """Median ms from an upsert's call to the first search that returns the item."""
    took, w = [], index.sig.shape[1]
    for i in range(n):
        x = _around(1, args.d, 500 + i)
        x = 30 * x / x.norm()
        t0 = time.perf_counter()
        index = live.upsert(index, torch.tensor([10 * args.n + i]), x, torch.zeros(1, w).long())
        found = index.search(x / 30, 10)[0]
        took.append(1e3 * (time.perf_counter() - t0))
        assert int(found[0, 0]) == 10 * args.n + i
    return {"median_ms": statistics.median(took), "max_ms": max(took), "n": n}


def memory(index: IVFIndex, args: argparse.Namespace) -> dict:
    """Resident bytes per upsert batch (and the segment's own bytes per batch)."""
    b, w = args.batch, index.sig.shape[1]
    before = rss_bytes()
    for j in range(args.mem_batches):
        ids = torch.arange(20 * args.n + j * b, 20 * args.n + (j + 1) * b)
        index = live.upsert(index, ids, _around(b, args.d, 900 + j), torch.zeros(b, w).long())
    grown = rss_bytes() - before
    seg = index.live
    assert seg is not None
    store = seg.store
    held = sum(t.nbytes for t in (store.ids, store.vectors, store.sig, store.lists, seg.alive))
    return {
        "rss_bytes_per_batch": grown / args.mem_batches,
        "segment_bytes_per_batch": held / args.mem_batches,
        "batches": args.mem_batches,
        "batch": b,
    }


def search_cost(index: IVFIndex, q: torch.Tensor, args: argparse.Namespace) -> list[dict]:
    """q/s (batched) and one query's p50 with a segment of each size (fresh rows, or as many
    tombstones), in turns with none."""
    rows, w = [], index.sig.shape[1]
    sizes = [int(s) for s in args.fresh.split(",")]
    for size, kind in [(s, k) for s in sizes for k in ("fresh", "tombstones")]:
        if kind == "fresh":
            ids = torch.arange(30 * args.n, 30 * args.n + size)
            x = _around(size, args.d, size)
            segment = live.upsert(index, ids, x, torch.zeros(size, w).long())
        else:
            segment = live.remove(index, torch.arange(0, args.n, args.n // size)[:size])
        out = {}
        for name, ix in (("none", index), ("fresh", segment), ("none2", index)):
            with torch.inference_mode():
                _, batched, _ = time_batched(lambda ix=ix: ix.search(q, 100), repeats=3)
                p50, _ = time_single(lambda i, ix=ix: ix.search(q[i % len(q)][None], 100), n=100)
            out[name] = {"qps": len(q) / batched, "p50_ms": p50}
        base_qps = (out["none"]["qps"] + out["none2"]["qps"]) / 2
        base_p50 = (out["none"]["p50_ms"] + out["none2"]["p50_ms"]) / 2
        rows.append(
            {
                "segment": kind,
                "fresh": size,
                "qps": out["fresh"]["qps"],
                "qps_without": base_qps,
                "p50_ms": out["fresh"]["p50_ms"],
                "p50_ms_without": base_p50,
                "qps_ratio": out["fresh"]["qps"] / base_qps,
                "p50_ratio": out["fresh"]["p50_ms"] / base_p50,
            }
        )
        print(f"{kind} {size}: {rows[-1]}", file=sys.stderr)
    return rows


def recall(index: IVFIndex, x: torch.Tensor, q: torch.Tensor, args: argparse.Namespace) -> dict:
    """recall@100 after upserts and removes: live, folded, rebuilt from scratch."""
    u, w = args.upserts, index.sig.shape[1]
    new_x = torch.from_numpy(make_data(u, args.d, 1).x) + 0.5 * _around(u, args.d, 7) / 3
    gone = torch.arange(0, args.n, max(1, args.n // u))[:u]
    updated = index
    for s in range(0, u, args.batch):
        ids = torch.arange(args.n + s, args.n + min(s + args.batch, u))
        updated = live.upsert(
            updated, ids, new_x[s : s + args.batch], torch.zeros(len(ids), w).long()
        )
    updated = live.remove(updated, gone)
    keep = torch.ones(args.n, dtype=torch.bool)
    keep[gone] = False
    all_ids = torch.cat([torch.arange(args.n)[keep], torch.arange(args.n, args.n + u)])
    all_x = torch.cat([x[keep], new_x])
    truth = all_ids[(q @ all_x.T).topk(100, dim=1).indices]
    folded = fold(updated)
    rebuilt = build_ivf(all_x, IVFConfig(nlist=args.nlist, nprobe=args.nprobe), item_ids=all_ids)

    def r(ix: IVFIndex) -> float:
        found = ix.search(q, 100)[0]
        hits = (found.unsqueeze(2) == truth.unsqueeze(1)).any(2).float()
        return float(hits.mean())

    out = {
        "live": r(updated),
        "folded": r(folded),
        "rebuilt": r(rebuilt),
        "upserts": u,
        "removes": u,
    }
    print(f"recall: {out}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    load_start, wall = os.getloadavg(), stopwatch()
    data = make_data(args.n, args.d, args.queries)
    x, q = torch.from_numpy(data.x), torch.from_numpy(data.q)
    cfg = IVFConfig(nlist=args.nlist, nprobe=args.nprobe)
    index = build_ivf(
        x, cfg, item_attributes=data.attributes, attribute_values=data.attribute_values
    )
    print(f"built {args.n} x {args.d} in {wall():.0f} s", file=sys.stderr)
    result = {
        "updates": update_rates(index, args),
        "ack_to_answer": ack_to_answer(index, args),
        "memory": memory(index, args),
        "search": search_cost(index, q, args),
        "recall@100": recall(index, x, q, args),
    }
    meta = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "wall_s": wall(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, {"meta": meta, **result}, indent=1)
    print(f"wrote {args.out} in {wall():.0f} s", file=sys.stderr)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
