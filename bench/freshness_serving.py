"""Freshness while serving: live updates applied while one-query searches are served at half the
index's max q/s, the served p99 with and without updates, and acknowledged upsert -> answerable.

In one process, on clustered vectors as ``bench/ann_data.py`` (N x D, IVF):

* **max q/s**: one query at a time, back to back (``--probe-s``); the serving rate is half of it;
* **phases in turns** (``--turns`` of each, ``--phase-s`` long, each from the index as built):
  ``quiet`` (searches only) and
  ``updates`` (searches, and an updater thread applying upsert, attribute-flip and remove
  batches of ``--batch`` items at ``--upserts-per-s`` / ``--flips-per-s`` / ``--removes-per-s``,
  each swapped in as a new index reference, as a server's update path does; past
  ``--compact-at`` a background thread folds the segment and rebases the updates made meanwhile,
  as ``serving/live/compactor.py``);
* **served latency**: open loop, each search timed from its scheduled start (a search that waits
  behind the one before counts the wait), p50 / p99 per phase kind;
* **ack -> answerable**: after each upsert batch the updater acknowledges (swaps in) one marker
  item too; the serving thread's next search asks for it, and the time from the ack to the first
  answer that returns it is taken (median, p99, max);
* **achieved update rates** and the resident memory's growth over each updates phase.

Run from the repository root::

    .venv/bin/python bench/freshness_serving.py --small   # 100k x 64
    .venv/bin/python bench/freshness_serving.py           # 1M x 64
    .venv/bin/python bench/freshness_serving.py --n 10000000 --nlist 8192 --nprobe 64 \\
        --out bench/results/freshness_serving_10m.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from ann_data import make_data
from freshness import rss_bytes
from timing import set_threads, stopwatch

from common.atomic import atomic_write_json
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index import live_index as live
from retrieval.index.compaction import fold, rebase


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="100k x 64, nlist 512")
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--nlist", type=int, default=2048)
    p.add_argument("--nprobe", type=int, default=32)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--batch", type=int, default=1000, help="items per update batch")
    p.add_argument(
        "--rates",
        default="5000:20000:1000,1000:2000:200",
        help="settings of upserts:flips:removes per second, each run in its own phases",
    )
    p.add_argument("--compact-at", type=int, default=10_000, help="0: never fold")
    p.add_argument("--phase-s", type=float, default=10.0)
    p.add_argument("--probe-s", type=float, default=4.0)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--load", type=float, default=0.5, help="served rate, a fraction of max q/s")
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/freshness_serving.json"))
    args = p.parse_args(argv)
    if args.small:
        args.n, args.nlist, args.nprobe = 100_000, 512, 16
    return args


@dataclass
class Served:
    """The index served now (a reference swapped whole, as a server's host does) and the update
    lock that the updater and the compaction's swap take."""

    index: IVFIndex
    lock: threading.Lock = field(default_factory=threading.Lock)
    marker: tuple[int, torch.Tensor, float] | None = None
    """The last acknowledged marker: (id, query that finds it, ack time)."""
    answerable_ms: list[float] = field(default_factory=list)
    compactions: int = 0
    compacting: bool = False
    compactor: threading.Thread | None = None


def max_qps(served: Served, q: torch.Tensor, args: argparse.Namespace) -> float:
    """One query at a time, back to back, for ``--probe-s``."""
    n, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        while time.perf_counter() - t0 < args.probe_s:
            served.index.search(q[n % len(q)][None], args.k)
            n += 1
    return n / (time.perf_counter() - t0)


def serve(
    served: Served, q: torch.Tensor, rate: float, seconds: float, k: int
) -> tuple[list[float], int]:
    """Open-loop searches at ``rate`` q/s for ``seconds`` -> (each one's ms from its scheduled
    start, how many were due but not started when the time was up: the backlog); a search while
    a marker is unanswered asks for the marker."""
    took: list[float] = []
    gap = 1.0 / rate
    start = time.perf_counter()
    i = 0
    with torch.inference_mode():
        while True:
            due = start + i * gap
            now = time.perf_counter()
            if due - start > seconds or now - start > seconds:
                return took, max(0, int(seconds * rate) - i)
            if due > now:
                time.sleep(due - now)
            marker = served.marker
            query = q[i % len(q)][None] if marker is None else marker[1]
            found = served.index.search(query, k)[0]
            done = time.perf_counter()
            took.append(1e3 * (done - due))
            if marker is not None and bool((found == marker[0]).any()):
                served.answerable_ms.append(1e3 * (done - marker[2]))
                served.marker = None
            i += 1


def compact(served: Served) -> None:
    """Folds a snapshot of the served segment, then rebases what changed since and swaps it in
    (``serving/live/compactor.py``'s two steps)."""
    base = served.index
    try:
        folded = fold(base)
        assert base.live is not None
        with served.lock:
            index = rebase(folded, base.live, served.index)
            if index is not None:
                served.index = index
                served.compactions += 1
    finally:
        served.compacting = False


class Updater(threading.Thread):
    """Applies upsert / flip / remove batches at their rates until stopped; counts items."""

    def __init__(self, served: Served, args: argparse.Namespace, first_id: int, seed: int):
        super().__init__(name="updater", daemon=True)
        self.served, self.args, self.next_id = served, args, first_id
        self.gen = torch.Generator().manual_seed(seed)
        self.stop = threading.Event()
        self.items = {"upsert": 0, "flip": 0, "remove": 0}
        self.batch_ms: dict[str, list[float]] = {"upsert": [], "flip": [], "remove": []}
        self.rss: list[int] = []
        self.seconds = 0.0

    def _batch(self, kind: str) -> None:
        a, b = self.args, self.args.batch
        w = self.served.index.sig.shape[1]
        t0 = time.perf_counter()
        with self.served.lock:
            index = self.served.index
            if kind == "upsert":
                ids = torch.arange(self.next_id, self.next_id + b + 1)
                x = torch.randn(b + 1, a.d, generator=self.gen) * 3
                x[-1] = 30 * x[-1] / x[-1].norm()  # the marker: first for its own direction
                self.next_id += b + 1
                index = live.upsert(index, ids, x, torch.zeros(b + 1, w, dtype=torch.long))
                marker = (int(ids[-1]), (x[-1] / 30)[None], 0.0)
            else:  # main items, spread over the catalog
                ids = torch.randint(0, a.n, (b,), generator=self.gen).unique()
                ids = ids[live.locate(index, ids)]
                if kind == "flip":
                    sig = torch.randint(0, 1 << 20, (len(ids), w), generator=self.gen)
                    index = live.relabel(index, ids, sig)
                else:
                    index = live.remove(index, ids)
                marker = None
            self.served.index = index  # acknowledged: visible to the next search
            acked = time.perf_counter()
        if marker is not None:
            self.served.marker = (marker[0], marker[1], acked)
        self.items[kind] += len(ids) - (kind == "upsert")
        self.batch_ms[kind].append(1e3 * (acked - t0))
        seg = index.live
        if (
            a.compact_at > 0
            and seg is not None
            and seg.size >= a.compact_at
            and not self.served.compacting
        ):
            self.served.compacting = True
            t = threading.Thread(target=compact, args=(self.served,), daemon=True)
            self.served.compactor = t
            t.start()

    def run(self) -> None:
        a = self.args
        rates = {"upsert": a.upserts_per_s, "flip": a.flips_per_s, "remove": a.removes_per_s}
        due = {kind: 0.0 for kind in rates}
        start = time.perf_counter()
        while not self.stop.is_set():
            now = time.perf_counter() - start
            kind = min(due, key=lambda kk: due[kk])
            if due[kind] > now:
                time.sleep(min(due[kind] - now, 0.01))
                continue
            self._batch(kind)
            due[kind] += a.batch / rates[kind]
            if len(self.rss) < 1 + now / 0.5:
                self.rss.append(rss_bytes())
        self.seconds = time.perf_counter() - start


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p)) if xs else float("nan")


def run_setting(index: IVFIndex, q: torch.Tensor, rate: float, args: argparse.Namespace) -> dict:
    """Phases in turns (quiet, updates) at one setting of the update rates, from ``index``."""
    served = Served(index)
    lat: dict[str, list[float]] = {"quiet": [], "updates": []}
    backlog = {"quiet": 0, "updates": 0}
    updaters: list[Updater] = []
    for turn in range(args.turns):
        for phase in ("quiet", "updates"):
            served.index = index  # each phase from the index as built: no segment left over
            up = None
            if phase == "updates":
                up = Updater(served, args, first_id=args.n + turn * 10_000_000, seed=turn)
                up.start()
            took, behind = serve(served, q, rate, args.phase_s, args.k)
            if up is not None:
                up.stop.set()
                up.join()
                if served.compactor is not None:
                    served.compactor.join()
                updaters.append(up)
                served.marker = None
            lat[phase] += took
            backlog[phase] += behind
            print(
                f"turn {turn} {phase}: p99 {pct(took, 99):.2f} ms, {behind} behind", file=sys.stderr
            )
    secs = sum(u.seconds for u in updaters)
    kinds = ("upsert", "flip", "remove")
    growth = [max(u.rss) - u.rss[0] for u in updaters if u.rss]
    out = {
        "target_per_s": {
            "upsert": args.upserts_per_s,
            "flip": args.flips_per_s,
            "remove": args.removes_per_s,
        },
        "served": {
            phase: {
                "n": len(v),
                "p50_ms": pct(v, 50),
                "p99_ms": pct(v, 99),
                "backlog": backlog[phase],
            }
            for phase, v in lat.items()
        },
        "p99_ratio": pct(lat["updates"], 99) / pct(lat["quiet"], 99),
        "updates_per_s": {k: sum(u.items[k] for u in updaters) / secs for k in kinds},
        "batch_ms": {
            k: statistics.median([m for u in updaters for m in u.batch_ms[k]] or [float("nan")])
            for k in kinds
        },
        "answerable_ms": {
            "median": pct(served.answerable_ms, 50),
            "p99": pct(served.answerable_ms, 99),
            "max": max(served.answerable_ms, default=float("nan")),
            "n": len(served.answerable_ms),
        },
        "compactions": served.compactions,
        "rss_growth_bytes_max": max(growth, default=0),
    }
    print(out, file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    load_start, wall = os.getloadavg(), stopwatch()
    data = make_data(args.n, args.d, args.queries)
    x, q = torch.from_numpy(data.x), torch.from_numpy(data.q)
    del data
    index = build_ivf(x, IVFConfig(nlist=args.nlist, nprobe=args.nprobe))
    del x
    print(f"built {args.n} x {args.d} in {wall():.0f} s", file=sys.stderr)
    top = max_qps(Served(index), q, args)
    rate = args.load * top
    print(f"max {top:.0f} q/s one at a time; serving at {rate:.0f} q/s", file=sys.stderr)
    settings = []
    for spec in args.rates.split(","):
        ups, flips, removes = (float(v) for v in spec.split(":"))
        args.upserts_per_s, args.flips_per_s, args.removes_per_s = ups, flips, removes
        settings.append(run_setting(index, q, rate, args))
    result = {"max_qps": top, "served_qps": rate, "settings": settings}
    print(result, file=sys.stderr)
    meta = {
        "args": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if not k.endswith("_per_s")  # each setting's, in its own row
        },
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
    main()
