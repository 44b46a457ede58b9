"""Where one request's time goes, process by process: ``recserve serve`` and the routed path
(router + shard servers) at 1 client, on one timeline.

Every server process this bench starts records a timestamp when certain functions are entered
and left (``bench/timeline_hook/sitecustomize.py``, loaded through ``PYTHONPATH``; the product is
not changed). ``time.monotonic_ns`` is one clock for all processes of a host, so the records merge
into one timeline. With one client, one request is in flight at a time: the records between two
arrivals at the front end are one request's path, and the gap from each record to the next says
where the time went (``--seconds`` of closed-loop load from ``bench/loadgen.py``, a process of
its own; medians over the requests whose path is the most common one).

What a row means:

* ``A:in -> A:out`` of one function is time inside it (including what it calls that is not
  recorded);
* ``A:out -> B:in`` in the same process is the code between them, or, across a thread hand-off
  (the front end's thread to the batcher), the wake-up too;
* a row whose two records are in different processes is a hop: serialization, the kernel's
  loopback, the other side's gRPC threads and the hand-off to its handler;
* the last row (the reply's way back to the load generator, its next request and that request's
  way in) is outside the servers.

Run from the repository root::

    .venv/bin/python bench/timeline.py --out bench/results/timeline.json   # serve, 1 and 2 shards

The timestamps cost about 1 us each (two per recorded call, ~40 a routed request), so the
total is a little above an untraced run's latency; compare rows, not totals, across runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the packages, not bench/serving.py

from loadgen import ready
from sharding_load import cluster, run_load, serve_model
from sharding_workload import MODEL, NO_FILTER, build_workload

from serving.repository.repository import ModelRepository

HOOK = Path(__file__).resolve().parent / "timeline_hook"
FRONT = "RecommendServicer.Recommend:in"
"""The record that starts a request's path at its front end (serve or router)."""

Record = tuple[int, str, int, str]
"""(monotonic ns, process name, thread id, point)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--items", type=int, default=20_000, help="catalog size")
    p.add_argument("--users", type=int, default=2_000, help="synthetic users")
    p.add_argument("--epochs", type=int, default=2, help="training epochs of the model")
    p.add_argument("--request-users", type=int, default=256, help="distinct users in requests")
    p.add_argument("--k", type=int, default=100)
    p.add_argument(
        "--configs",
        default="serve,1,2",
        help="what to time, comma-separated: serve (recserve serve model) and shard counts",
    )
    p.add_argument("--filter", default="category in {news, music}", help="the filtered case")
    p.add_argument("--filtered", action="store_true", help="time the filtered requests")
    p.add_argument("--seconds", type=float, default=4.0, help="load per configuration")
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--serve-threads", type=int, default=2, help="torch threads of serve")
    p.add_argument("--device", default="cpu", help="where serve runs its model (serve only)")
    p.add_argument("--shard-threads", type=int, default=0, help="0: recserve cluster's split")
    p.add_argument("--shard-deadline-ms", type=int, default=1000)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/timeline.json"))
    return p.parse_args(argv)


# ---- records -> one request's path -------------------------------------------------------------
def read_records(directory: Path, names: dict[int, str]) -> list[Record]:
    """Every process's records, merged in time order (a process not in ``names`` is named by
    its pid)."""
    out: list[Record] = []
    for path in directory.glob("*.txt"):
        who = names.get(int(path.stem), path.stem)
        for line in path.read_text().splitlines():
            t, tid, point = line.split(" ", 2)
            out.append((int(t), who, int(tid), point))
    out.sort()
    return out


def request_paths(records: list[Record], since_ns: int) -> tuple[list[list[Record]], list[int]]:
    """The records from each arrival at the front end to the next one (after ``since_ns``),
    and each next arrival's time."""
    starts = [i for i, r in enumerate(records) if r[3] == FRONT and r[0] >= since_ns]
    paths = [records[a:b] for a, b in itertools.pairwise(starts)]
    return paths, [records[b][0] for b in starts[1:]]


def path_table(paths: list[list[Record]], next_start: list[int]) -> dict[str, Any]:
    """The most common path (by process and point) and the median gap after each record;
    ``next_start[i]``: when the request after ``paths[i]`` arrived (the last row ends there)."""

    def key(path: list[Record]) -> tuple[tuple[str, str], ...]:
        return tuple((who, point) for _, who, _, point in path)

    common, count = Counter(key(p) for p in paths).most_common(1)[0]
    same = [(p, nxt) for p, nxt in zip(paths, next_start, strict=True) if key(p) == common]
    rows = []
    for i, (who, point) in enumerate(common):
        last = i + 1 == len(common)
        gaps = [(nxt if last else p[i + 1][0]) - p[i][0] for p, nxt in same]
        after = ("load generator", "(reply, next request)") if last else common[i + 1]
        rows.append(
            {
                "from": f"{who} {point}",
                "to": f"{after[0]} {after[1]}",
                "median_us": statistics.median(gaps) / 1e3,
            }
        )
    total = sum(r["median_us"] for r in rows)
    return {"requests": len(paths), "on_common_path": count, "rows": rows, "total_us": total}


# ---- one configuration -------------------------------------------------------------------------
def run_config(
    config: str, work: Any, tmp: Path, args: argparse.Namespace, pool: ProcessPoolExecutor
) -> dict[str, Any]:
    """Starts ``config`` with the hook, loads it at 1 client, -> its path table."""
    records = tmp / f"records-{config}"
    records.mkdir()
    root = tmp / f"repo-{config}"
    shards = 0 if config == "serve" else int(config)
    ModelRepository(root).publish(MODEL, work.model, **({"shards": shards} if shards else {}))
    os.environ["RECSERVE_TIMELINE_DIR"] = str(records)
    try:
        servers: AbstractContextManager[Any] = (
            serve_model(root, tmp / "serve.log", args)
            if config == "serve"
            else cluster(root, shards, 0, tmp / f"cluster-{config}", args)
        )
        with servers as running:
            if config == "serve":
                address, names = running.address, {running.proc.pid: "serve"}
            else:
                address = running.router.address
                names = {p.pid: p.name for p in running.processes}
            label = args.filter if args.filtered else NO_FILTER
            since = time.monotonic_ns() + int(args.warmup_s * 1e9)
            got = pool.submit(
                run_load, address, work.payloads(label), 1, args.warmup_s, args.seconds, {}
            ).result()
    finally:
        del os.environ["RECSERVE_TIMELINE_DIR"]
    table = path_table(*request_paths(read_records(records, names), since))
    return {"config": config, "p50_ms": got["p50_ms"], "qps": got["qps"], **table}


def render(result: dict[str, Any]) -> str:
    lines = [
        f"### {result['config']}: p50 {result['p50_ms']:.2f} ms at 1 client "
        f"({result['on_common_path']} of {result['requests']} requests on this path; "
        f"medians sum to {result['total_us'] / 1e3:.2f} ms)",
        "",
        "| from | to | median us |",
        "|---|---|---|",
    ]
    lines += [f"| {r['from']} | {r['to']} | {r['median_us']:.0f} |" for r in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = build_workload(args)
    # every server this run starts loads the hook (PYTHONPATH is inherited)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HOOK), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="recserve-timeline-") as tmp,
        ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool,
    ):
        pool.submit(ready).result()
        for config in args.configs.split(","):
            results.append(run_config(config, work, Path(tmp), args, pool))
            print(render(results[-1]) + "\n", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
