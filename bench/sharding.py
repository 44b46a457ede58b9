"""Document-sharding benchmark: the production path (router, shard servers, embedding servers)
against ``recserve serve`` (the unsharded model in one process) -- one run, one model, one load
generator.

One synthetic catalog (``--items``, default 200k; ``--small``: 20k) and one model, trained
``--epochs`` (default 2) with nprobe tuned for recall 0.97 on users' queries as ``recserve
train`` does (``bench/sharding_workload.py``). Measured, in this order, on the same requests:

* in-process, unsharded: ``model(batch, k)`` -- single-user latency (p50/p99 over many calls)
  and batched throughput (``--batch`` users per call): what a request costs with no serving;
* ``recserve serve model`` (the baseline): one process with ``--serve-threads`` torch threads
  (default: what the 1-shard cluster's router and shard server get together), gRPC
  ``Recommend`` from a load generator in a separate process, closed loop with C clients
  (``--concurrency``) for ``--seconds``: q/s, p50, p99, partial answers and errors. It stays
  up for the whole run, and every configuration below is loaded in turns with it (serve at C,
  the configuration at C, serve at the next C, ...): this machine's speed drifts by up to 1.5x
  over minutes, which a serve run measured once, first, would put into every ratio;
* the shard hop floor: the router's own ``Search`` requests from one client to a grpcio server
  that answers each with a fixed answer of a real one's size (no search): what one hop to a
  shard costs by itself, which the routed p50 at 1 client pays over serve's;
* per shard count S (``--shards``), the version published with ``shards=S``:

  - local merge: the router's own ``RouterRunner.forward`` with the S shard indexes called in
    this thread (wire encoding included, no gRPC): the cost of splitting and merging;
  - in-process router: S ``ShardServer`` and a router ``Server`` in this process, requests
    through its batcher (``state.recommend``), shards over loopback gRPC;
  - the real serving path: ``recserve cluster up --shards S`` (router and S shard servers as
    processes on 127.0.0.1), the same load generator, clients and requests as the baseline;
* per S in ``--remote-shards`` (default 2): the same with ``--embedding-servers 1``, on a
  version whose coldest tables (all but the item table) live on the embedding server (FP32, so
  the answers stay exact).

Every load case records the CPU each process (router, each shard, embedding server, serve, the
load generator) spent in its measured window (``/proc/<pid>/stat``) per answered request: the
router, shards and load generator share this machine's cores, so q/s here shows sharing, not
scale-out, while CPU per request is what scales on hosts of their own. Every server's answers
for a few users are checked against the in-process forward (ids equal, scores within 1e-4).
The verdicts (``bench/sharding_report.py``): per configuration, max q/s at p99 <= ``--p99-ms``
(the highest q/s among the concurrencies whose p99 fits) / serve's (targets: 1 shard >= 0.8x,
2 shards >= 0.5x) and p50 at 1 client minus serve's (target <= +1 ms). Each case runs
unfiltered and with ``--filter``; the targets are judged on both. ``recserve cluster down`` in a
``finally``; at the end no shard server of this run is left (``pgrep -f "recserve serve
shard"``).

Run from the repository root::

    .venv/bin/python bench/sharding.py --small        # 20k items, S=1,2, ~9 min on 2 cores
    .venv/bin/python bench/sharding.py                # 200k items, S=1,2,4

Writes ``--out`` (default ``bench/results/sharding.json``, ``sharding_small.json`` with
``--small``) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen import ready
from sharding_inprocess import inprocess_cases, inprocess_router_cases, local_merge_cases
from sharding_load import (
    check_equal,
    cluster,
    cluster_threads,
    hop_floor_case,
    leftover_shard_servers,
    load_cases,
    serve_model,
)
from sharding_report import add_ratios, config_name, render, summarize
from sharding_workload import MODEL, Workload, build_workload, publish_remote
from timing import OtherLoad, int_list

from serving.repository.repository import ModelRepository

ROOT = Path(__file__).resolve().parents[1]


# ---- arguments ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="20k items, S=1,2, shorter cases")
    p.add_argument("--items", type=int, help="catalog size (default 200k, 20k with --small)")
    p.add_argument("--users", type=int, default=2000, help="synthetic users")
    p.add_argument(
        "--epochs",
        type=int,
        default=2,
        help="training epochs of the model (0: untrained weights, IVF's worst case)",
    )
    p.add_argument("--request-users", type=int, default=256, help="distinct users in requests")
    p.add_argument("--shards", type=int_list, help="shard counts (default 1,2,4; 1,2 with --small)")
    p.add_argument(
        "--remote-shards",
        type=int_list,
        default=[2],
        help="shard counts also run with 1 embedding server holding the coldest tables",
    )
    p.add_argument("--no-remote", action="store_true", help="skip the embedding-server cases")
    p.add_argument(
        "--concurrency",
        type=int_list,
        default=[1, 4, 6, 8, 10, 12, 16],
        help="closed-loop clients (a fine grid: the verdicts take the best level under the "
        "p99 budget, and a coarse one puts a configuration just over the line a whole level down)",
    )
    p.add_argument("--p99-ms", type=float, default=20.0, help="latency budget of the verdicts")
    p.add_argument("--k", type=int, default=100, help="results per request")
    p.add_argument("--filter", default="category in {news, music}", help="the filtered case")
    p.add_argument("--seconds", type=float, help="measured seconds per load case (default 8; 3)")
    p.add_argument("--warmup-s", type=float, default=1.0, help="untimed seconds per load case")
    p.add_argument("--single", type=int, default=300, help="timed one-user calls per latency")
    p.add_argument("--batch", type=int, default=256, help="users per in-process batched call")
    p.add_argument("--check-users", type=int, default=4, help="users checked against in-process")
    p.add_argument(
        "--shard-deadline-ms",
        type=float,
        default=200.0,
        help="router's deadline per shard call (`cluster up`'s default: 200)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads in this process")
    p.add_argument(
        "--shard-threads",
        type=int,
        default=0,
        help="`cluster up --shard-threads`: torch threads of each shard server (0: its default)",
    )
    p.add_argument(
        "--serve-threads",
        type=int,
        help="`recserve serve model --torch-threads` (default: what `cluster up --shards 1` "
        "gives its router and shard server together)",
    )
    p.add_argument(
        "--no-inprocess-router", action="store_true", help="skip the in-process router case"
    )
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="per server start")
    p.add_argument("--out", type=Path, help="JSON results (default bench/results/sharding*.json)")
    args = p.parse_args(argv)
    args.items = args.items or (20_000 if args.small else 200_000)
    args.seconds = args.seconds or (3.0 if args.small else 8.0)
    args.shards = args.shards or ([1, 2] if args.small else [1, 2, 4])
    args.remote_shards = [] if args.no_remote else args.remote_shards
    args.serve_threads = args.serve_threads or 2 * cluster_threads(1)
    if args.out is None:
        name = "sharding_small.json" if args.small else "sharding.json"
        args.out = ROOT / "bench" / "results" / name
    if args.k > args.items:
        p.error(f"--k {args.k}: must be <= --items {args.items}")
    if args.request_users > args.users or args.check_users > args.request_users:
        p.error("need --check-users <= --request-users <= --users")
    return args


# ---- what ran where -----------------------------------------------------------------------------
def environment(work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Machine, versions, the index's shape, threads and what else ran at the start."""
    idx = work.model.index
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "serve_torch_threads": args.serve_threads,
        "cluster_torch_threads": {s: cluster_threads(s) for s in args.shards},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpc": grpc.__version__,
        "items": idx.ntotal,
        "dim": idx.dim,
        "nlist": idx.nlist,
        "nprobe": idx.config.nprobe,
        "codes": idx.config.codes,
        "epochs": args.epochs,
        "argv": sys.argv[1:],
        "other_load_at_start": _idle_other_load(),
        "loadavg_at_start": os.getloadavg(),
    }


def _idle_other_load(seconds: float = 1.0) -> float:
    """Share of the machine's CPU that other processes used over ``seconds`` before the run."""
    load = OtherLoad()
    load.start()
    time.sleep(seconds)
    return load.stop()


# ---- 3. the production path under load: `recserve serve model` and `recserve cluster up` --------
Target = tuple[dict[str, Any], str, dict[str, int]]
"""A server under load: ``(case, address, pids)`` (``sharding_load.load_cases``)."""


@contextmanager
def serve_target(
    tmp: Path, work: Workload, args: argparse.Namespace, results: dict[str, Any]
) -> Iterator[Target]:
    """The baseline, up for the whole run: the unsharded version under ``recserve serve
    model``, checked; each configuration's load cases take turns with it."""
    root = tmp / "repo-serve"
    ModelRepository(root).publish(MODEL, work.model)
    case = {"system": "serve", "shards": 0, "embedding_servers": 0}
    started = time.perf_counter()
    with serve_model(root, tmp / "serve.log", args) as run:
        startup_s = time.perf_counter() - started
        print(f"recserve serve model up in {startup_s:.1f} s at {run.address}", flush=True)
        checks = check_equal(run.address, work, work.users[: args.check_users])
        results.setdefault("checks", []).extend(
            {**case, "startup_s": startup_s, **c} for c in checks
        )
        yield case, run.address, {"serve": run.proc.pid}


def cluster_cases(
    root: Path,
    shards: int,
    embedding_servers: int,
    serve: Target,
    tmp: Path,
    work: Workload,
    pool: ProcessPoolExecutor,
    loadgen_pid: int,
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    """``recserve cluster up`` on the version in ``root``, checked, then loaded in turns with
    ``serve`` (its rows name this configuration in ``pair``)."""
    case = {"system": "cluster", "shards": shards, "embedding_servers": embedding_servers}
    started = time.perf_counter()
    name = f"cluster-{shards}-{embedding_servers}"
    with cluster(root, shards, embedding_servers, tmp / name, args) as running:
        startup_s = time.perf_counter() - started
        address = running.router.address
        print(f"{name} up in {startup_s:.1f} s at {address}", flush=True)
        checks = check_equal(address, work, work.users[: args.check_users])
        for c in checks:
            print(json.dumps({"case": "check", **case, **c}), flush=True)
        pids = {p.name: p.pid for p in running.processes}
        serve_case, serve_address, serve_pids = serve
        paired = {**serve_case, "pair": config_name(shards, embedding_servers)}
        targets = [(paired, serve_address, serve_pids), (case, address, pids)]
        rows = load_cases(targets, work, pool, loadgen_pid, args)
    return {
        "checks": [{**case, "startup_s": startup_s, **c} for c in checks],
        "load": rows,
    }


def shard_count_cases(
    shards: int,
    serve: Target,
    tmp: Path,
    work: Workload,
    pool: ProcessPoolExecutor,
    loadgen_pid: int,
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    """Publishes the S-shard version in its own repository, then every S case."""
    root = tmp / f"repo-{shards}"
    repo = ModelRepository(root)
    version = repo.publish(MODEL, work.model, shards=shards)
    out: dict[str, list[dict[str, Any]]] = {
        "local_merge": local_merge_cases(repo, version, shards, work, args)
    }
    if not args.no_inprocess_router:
        out["inprocess_router"] = inprocess_router_cases(root, shards, work, args)
    out.update(cluster_cases(root, shards, 0, serve, tmp, work, pool, loadgen_pid, args))
    return out


def remote_cases(
    shards: int,
    serve: Target,
    tmp: Path,
    work: Workload,
    pool: ProcessPoolExecutor,
    loadgen_pid: int,
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    """S shards and 1 embedding server holding the coldest tables."""
    root = tmp / f"repo-{shards}-remote"
    published = publish_remote(root, work, shards)
    print(f"{shards} shards, remote tables {published['remote_tables']}", flush=True)
    out = cluster_cases(root, shards, 1, serve, tmp, work, pool, loadgen_pid, args)
    out["remote_tables"] = [{"shards": shards, "tables": published["remote_tables"]}]
    return out


# ---- main ---------------------------------------------------------------------------------------
def run_all(work: Workload, tmp: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The in-process baseline and the hop floor, then every shard count and remote case, each
    in turns with serve."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        loadgen_pid = pool.submit(ready).result()  # exists before any timing
        results["inprocess"] = inprocess_cases(work, args)
        results["hop_floor"] = hop_floor_case(work, tmp, pool, args)
        with serve_target(tmp, work, args, results) as serve:
            for s in args.shards:
                cases = shard_count_cases(s, serve, tmp, work, pool, loadgen_pid, args)
                for kind, rows in cases.items():
                    results.setdefault(kind, []).extend(rows)
            for s in args.remote_shards:
                for kind, rows in remote_cases(
                    s, serve, tmp, work, pool, loadgen_pid, args
                ).items():
                    results.setdefault(kind, []).extend(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    work = build_workload(args)
    env = environment(work, args)
    print(f"{args.items:,} items, K={args.k}, model built in {time.perf_counter() - t0:.1f} s")
    print(json.dumps(env), flush=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results: dict[str, Any] = {"config": config, "environment": env}
    with tempfile.TemporaryDirectory(prefix="recserve-sharding-") as tmp:
        try:
            run_all(work, Path(tmp), args, results)
        finally:
            results["leftover_shard_servers"] = leftover_shard_servers(tmp)
    add_ratios(results)
    results["summary"] = summarize(results, args.p99_ms)
    results["wall_s"] = time.perf_counter() - t0
    print("\n" + render(results))
    print(
        f"\nshard servers left by this run: {results['leftover_shard_servers']['ours'] or 'none'}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
