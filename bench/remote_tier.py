"""The remote tier against the same tables local: lookup latency and CPU per request (issue 17).

Issue 17's target: with the model's user tables remote (Zipf 1.1 ids, the caches at their default
size) a Recommend's p50 is at most 1.5x the same model's with every table local. Two cases, each
against its local twin in the same run, on one ``recserve serve embeddings`` process on 127.0.0.1:

* ``lookup``: tiny tables (``--tiny-rows``, one id per user each, like the model's user features)
  and one big table (``--big-rows``, ``--big-ids`` ids per user), ``--dtype`` rows; ids Zipf(1.1)
  truncated to each table, over a fixed permutation of its rows (``bench/zipf_ids.py``). The remote
  plan is the planner's (``plan``), caches at their default size (``Budgets.cache`` holds any
  ``cache_fraction`` of the rows). Per request of B users (``--users``): p50 / p99 of one
  ``TieredEmbeddingCollection`` call, CPU ms per call of this process (``time.process_time``:
  every thread, gRPC's included) and of the embedding server (``/proc``), the caches' hit rates.
* ``model``: the bench model (``bench/bench_model.py``, untrained: latency only) with every table
  but the item table on the embedding server (``bench/sharding_workload.py``'s budgets), one user
  per request, users drawn Zipf(1.1): p50 of ``model(batch, K)``, the in-process Recommend.

Answers are checked equal to the local twin's. Run from the repository root::

    .venv/bin/python bench/remote_tier.py --out bench/results/remote_tier.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import int_list, percentiles, pid_cpu_s
from zipf_ids import ZipfIds

from common import process
from sharded_tables.export import remote_routing, write_server_folders
from sharded_tables.planner import Budgets, plan
from sharded_tables.remote.client import RemoteTables
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.tiered import TieredEmbeddingCollection


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny-rows", type=int_list, default=[100, 1000, 5000])
    p.add_argument("--big-rows", type=int, default=1_000_000, help="0: no big table")
    p.add_argument("--big-ids", type=int, default=10, help="ids of the big table per user")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--dtype", default="fp32", choices=[d.value for d in DType])
    p.add_argument("--users", type=int_list, default=[1, 8], help="users per request")
    p.add_argument("--calls", type=int, default=300, help="timed calls per case")
    p.add_argument("--warm", type=int, default=300, help="untimed calls first (warm caches)")
    p.add_argument("--cases", default="lookup,model", help="lookup, model, or both")
    p.add_argument("--k", type=int, default=100, help="results per request (model case)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def start_server(folder: Path, log: Path) -> tuple[process.Proc, str]:
    cmd = [sys.executable, "-m", "recserve", "serve", "embeddings", "--folder", str(folder)]
    proc = process.start([*cmd, "--grpc-port", "0", "--memory-budget", "64GiB"], log_path=log)
    ready = proc.wait_ready(60.0)
    assert ready.grpc
    return proc, ready.grpc


def measure(fn: Callable[[Any], object], inputs: list[Any], server_pid: int | None) -> dict:
    """Wall ms of each call (p50, p99) and CPU ms per call of this process and of the server."""
    lat = []
    server0 = pid_cpu_s(server_pid) if server_pid else None
    cpu0 = time.process_time()
    for x in inputs:
        t0 = time.perf_counter()
        fn(x)
        lat.append((time.perf_counter() - t0) * 1e3)
    cpu = (time.process_time() - cpu0) * 1e3 / len(inputs)
    p50, p99 = percentiles(lat)
    out = {"p50_ms": p50, "p99_ms": p99, "mean_ms": statistics.fmean(lat), "cpu_ms": cpu}
    if server0 is not None and server_pid:
        out["server_cpu_ms"] = ((pid_cpu_s(server_pid) or server0) - server0) * 1e3 / len(inputs)
    return out


def hit_rates(coll: TieredEmbeddingCollection) -> dict[str, float]:
    """Per remote table: its hot-row cache's hit rate; 1.0 for a table copied whole."""
    whole = getattr(getattr(coll, "remote_tier", None), "whole", ())  # absent before issue 17
    return {t: round(s["hit_rate"], 4) for t, s in coll.cache_stats().items()} | dict.fromkeys(
        whole, 1.0
    )


def zipf_requests(
    zipf: dict[str, ZipfIds], users: int, big_ids: int, count: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    """``count`` requests ``{table: ids [users, L]}``: L = 1, or ``big_ids`` for ``big``."""
    rng = np.random.default_rng(seed)
    return [
        {n: z.draw((users, big_ids if n == "big" else 1), rng) for n, z in zipf.items()}
        for _ in range(count)
    ]


def lookup_case(args: argparse.Namespace, tmp: Path, record: Callable[[dict], None]) -> None:
    dtype = DType(args.dtype)
    specs = [
        TableSpec(f"tiny_{r}", r, args.dim, dtype=dtype, pooling="mean", features=(f"tiny_{r}",))
        for r in args.tiny_rows
    ]
    if args.big_rows:
        specs.append(TableSpec("big", args.big_rows, args.dim, dtype=dtype, pooling="mean"))
    total = sum(s.bytes() for s in specs)
    budgets = Budgets(device=0, host=0, remote_per_server=total + (1 << 20), remote_servers=1)
    budgets = Budgets(**{**budgets.to_dict(), "cache": total})  # caches: their default size
    remote_plan = plan(specs, budgets)
    assert all(p.tier is Tier.REMOTE for p in remote_plan.tables)
    local_plan = plan(specs, Budgets(device=0, host=total))
    torch.manual_seed(0)
    weights = {s.name: torch.randn(s.rows, s.dim) for s in specs}
    local = TieredEmbeddingCollection(specs, local_plan)
    local.load_float(weights)
    rows = TieredEmbeddingCollection(specs, remote_plan).load_float(weights)
    folders = write_server_folders(remote_plan, specs, rows, tmp / "lookup")
    del rows
    proc, address = start_server(folders[0], tmp / "lookup.log")
    zipf = {s.name: ZipfIds(s.rows, 1.1, table_seed=i) for i, s in enumerate(specs)}
    try:
        for users in args.users:
            warm = zipf_requests(zipf, users, args.big_ids, args.warm, seed=1)
            timed = zipf_requests(zipf, users, args.big_ids, args.calls, seed=10**6)
            client = RemoteTables(remote_routing(remote_plan, specs, [address]), timeout=10.0)
            coll = TieredEmbeddingCollection(specs, remote_plan, remote=client, timeout=10.0)
            with torch.inference_mode():
                for f in warm:
                    coll(f)
                for f in timed[:20]:  # the answers equal the local twin's
                    got, want = coll(f), local(f)
                    for n in want:
                        torch.testing.assert_close(got[n], want[n])
                fetched0 = coll.remote_stats().fetched
                remote = measure(coll, timed, proc.pid)
                local_m = measure(local, timed, None)
            remote["fetched_ids_per_call"] = (coll.remote_stats().fetched - fetched0) / len(timed)
            remote["rpcs_per_call"] = sum(client.stats()["requests"].values()) / (
                len(warm) + 20 + len(timed)
            )
            record({
                "case": "lookup", "users": users, "remote": remote, "local": local_m,
                "p50_vs_local": remote["p50_ms"] / local_m["p50_ms"],
                "hit_rates": hit_rates(coll),
                "cache_rows": {p.table: p.cache_rows for p in remote_plan.tables},
            })  # fmt: skip
            client.close()
    finally:
        process.stop_all([proc], timeout_s=10.0)


def model_case(args: argparse.Namespace, tmp: Path, record: Callable[[dict], None]) -> None:
    from bench_model import trained_model
    from sharding_workload import coldest_remote_budgets

    from retrieval.model import table_specs
    from retrieval.tiering import tier_model

    prep, model = trained_model(2000, 20_000, 0)
    specs = table_specs(model.config, DType.FP32)
    remote_plan = plan(specs, coldest_remote_budgets(model))
    local, _ = tier_model(model, Budgets(device=0, host=1 << 30), dtype=DType.FP32)
    tiered, rows = tier_model(model, placement=remote_plan)
    folders = write_server_folders(remote_plan, specs, rows, tmp / "model")
    proc, address = start_server(folders[0], tmp / "model.log")
    try:
        client = RemoteTables(remote_routing(remote_plan, specs, [address]), timeout=10.0)
        tiered.tables.remote = client
        rng = np.random.default_rng(5)
        users = ZipfIds(prep.dataset.num_users).draw((args.warm + args.calls,), rng).numpy()
        batches = [prep.user_batch(users[i : i + 1]) for i in range(len(users))]
        warm, timed = batches[: args.warm], batches[args.warm :]
        with torch.inference_mode():
            for b in warm:
                tiered(b, args.k)
            for b in timed[:20]:
                assert torch.equal(tiered(b, args.k)[0], local(b, args.k)[0])
            remote = measure(lambda b: tiered(b, args.k), timed, proc.pid)
            local_m = measure(lambda b: local(b, args.k), timed, None)
        record({
            "case": "model", "users": 1, "remote": remote, "local": local_m,
            "p50_vs_local": remote["p50_ms"] / local_m["p50_ms"],
            "hit_rates": hit_rates(tiered.tables),  # type: ignore[arg-type]
            "remote_tables": [p.table for p in remote_plan.tables if p.tier is Tier.REMOTE],
            "cache_rows": {p.table: p.cache_rows for p in remote_plan.tables},
        })  # fmt: skip
        client.close()
    finally:
        process.stop_all([proc], timeout_s=10.0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "argv": sys.argv[1:],
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
        "cases": [],
    }  # fmt: skip

    def record(case: dict) -> None:
        results["cases"].append(case)
        r, lo = case["remote"], case["local"]
        print(
            f"{case['case']:<6} B={case['users']}: remote p50 {r['p50_ms']:.3f} ms "
            f"(local {lo['p50_ms']:.3f}, x{case['p50_vs_local']:.2f}), p99 {r['p99_ms']:.3f}; "
            f"CPU/call {r['cpu_ms']:.3f} ms (local {lo['cpu_ms']:.3f}, server "
            f"{r.get('server_cpu_ms', float('nan')):.3f}); hit rates {case['hit_rates']}",
            flush=True,
        )

    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if "lookup" in cases:
            lookup_case(args, Path(tmp), record)
        if "model" in cases:
            model_case(args, Path(tmp), record)
    results["machine"]["loadavg_end"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
