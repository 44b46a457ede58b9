"""The routed path with the item table on an embedding server, read through its hot-row cache
(issue 17's remote-tier target at the Recommend level, on a table that is not copied whole).

``bench/remote_tier.py`` measures lookups, and its model case has only tables small enough to be
copied whole; here the hottest and largest table, the item table (``history_len`` ids a user),
lives on one embedding server with the planner's default cache (``cache_fraction`` of its rows,
``cache_whole_max = 0``: never a whole copy), so most requests miss some rows. The same trained
model (``bench/sharding_workload.py``, the flags of ``bench/sharding.py``) is published twice
and served by ``recserve cluster up --shards 1``:

* ``local``: every table in the router's process;
* ``hot``: the item table on 1 embedding server (``--embedding-servers 1``), FP32 (answers equal);
* ``hot, baseline tree`` (with ``--baseline-tree``): the ``hot`` version served by another
  checkout's code (e.g. ``git archive`` of the commit before a change), as an A/B in one run.

The configurations take turns at every concurrency (``sharding_load.load_cases``), ``--rounds``
times: q/s, p50, p99 and CPU per request of each process, then each system's p50 and q/s over
``local``'s in the same round, with the median over rounds. Every cluster's answers for a few
users are checked against the in-process forward first. Run from the repository root::

    .venv/bin/python bench/remote_hot.py --small --request-users 2000 --concurrency 1,4,8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sharding
from loadgen import ready
from sharding_load import check_equal, load_cases, processes_mentioning, stop_pids
from sharding_workload import MODEL, Workload, build_workload

from recserve.cluster import Cluster
from retrieval.model import table_specs
from retrieval.tiering import tier_model
from serving.repository.repository import ModelRepository
from sharded_tables.planner import Budgets, plan
from sharded_tables.specs import DType, Tier

ROOT = Path(__file__).resolve().parents[1]


def hot_item_budgets(work: Workload) -> Budgets:
    """The item table on one embedding server with a default-size cache, never copied whole;
    every other table in the router's host tier."""
    specs = table_specs(work.model.config, DType.FP32)
    item = next(s for s in specs if s.name == "item")
    rest = sum(s.bytes(DType.FP32) for s in specs if s is not item)
    return Budgets(
        device=0,
        host=rest + 4096,
        remote_per_server=2 * item.bytes(DType.FP32),
        remote_servers=1,
        cache=item.bytes(DType.FP32),  # room for cache_fraction of its rows
        cache_whole_max=0,
    )


@contextmanager
def cluster_from(
    tree: Path, repo: Path, embedding_servers: int, directory: Path, args: argparse.Namespace
) -> Iterator[Cluster]:
    """``recserve cluster up --shards 1`` run from the checkout ``tree`` (its code serves)."""

    def recserve(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": f"{tree}:{path}" if path else str(tree)}
        cmd = [sys.executable, "-m", "recserve", *argv]
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=tree, env=env
        )

    try:
        up = recserve(
            "cluster", "up", "--model-repo", str(repo), "--model", MODEL, "--shards", "1",
            "--embedding-servers", str(embedding_servers), "--directory", str(directory),
            "--shard-deadline-ms", str(args.shard_deadline_ms),
            "--shard-threads", str(args.shard_threads), timeout=args.startup_timeout_s,
        )  # fmt: skip
        if up.returncode != 0:
            raise RuntimeError(f"cluster up from {tree} failed:\n{up.stderr}{up.stdout}")
        yield Cluster.load(directory)
    finally:
        if (directory / "cluster.json").exists():
            recserve("cluster", "down", "--directory", str(directory), timeout=120)
        stop_pids(processes_mentioning(str(repo)))


def ratios_to_local(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (filter, C, system other than local): p50 and q/s over ``local``'s in the same round,
    each round's p50 ratio and the medians over rounds."""
    by_key = {(r["filter"], r["concurrency"], r["round"], r["system"]): r for r in rows}
    out = []
    for f, c, system in dict.fromkeys((r["filter"], r["concurrency"], r["system"]) for r in rows):
        if system == "local":
            continue
        pairs = [
            (r, by_key[(f, c, r["round"], "local")])
            for r in rows
            if (r["filter"], r["concurrency"], r["system"]) == (f, c, system)
        ]
        p50 = [r["p50_ms"] / loc["p50_ms"] for r, loc in pairs]
        qps = [r["qps"] / loc["qps"] for r, loc in pairs]
        out.append({
            "filter": f, "concurrency": c, "system": system, "p50_each": p50,
            "p50": statistics.median(p50), "qps": statistics.median(qps),
        })  # fmt: skip
    return out


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (threads it starts later inherit their creator's)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


def embedding_core(processes: list[tuple[str, int]], own: list[int]) -> dict[str, list[int]]:
    """The embedding servers (``embed-*`` of the ``(name, pid)`` ``processes``) on this
    machine's last CPU and every other process (the rest, and ``own``: this one, the load
    generator) on the others, as if the embedding server had a host of its own (on 2 shared
    cores its CPU is otherwise every request's latency). -> the CPUs given."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--embedding-core needs at least 2 CPUs")
    last, rest = {cpus[-1]}, set(cpus[:-1])
    for name, pid in processes:
        pin(pid, last if name.startswith("embed") else rest)
    for pid in own:
        pin(pid, rest)
    return {"embedding servers": sorted(last), "others": sorted(rest)}


def main(argv: list[str] | None = None) -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--baseline-tree", type=Path, help="another checkout to serve `hot` from")
    own.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "remote_hot.json")
    own.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times the systems take turns at each load case (the summary takes each ratio's "
        "median over rounds, which outlasts this machine's drift)",
    )
    own.add_argument(
        "--embedding-core",
        action="store_true",
        help="the embedding server on a CPU of its own, every other process on the others (an "
        "embedding server on its own host, as deployed)",
    )
    mine, rest = own.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        own.print_help()
        print("\nand the workload and load flags of bench/sharding.py:")
    args = sharding.parse_args(rest)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    work = build_workload(args)
    placement = plan(table_specs(work.model.config, DType.FP32), hot_item_budgets(work))
    item = placement.placement("item")
    assert item.tier is Tier.REMOTE and 0 < item.cache_rows < work.model.config.num_items
    print(f"model built in {time.perf_counter() - t0:.0f} s; item cache {item.cache_rows} rows")
    results: dict[str, Any] = {"argv": sys.argv[1:], "cache_rows": item.cache_rows, "checks": []}
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="recserve-remote-hot-") as tmp_s, ExitStack() as up:
        tmp = Path(tmp_s)
        local_repo, hot_repo = tmp / "repo-local", tmp / "repo-hot"
        ModelRepository(local_repo).publish(MODEL, work.model, shards=1)
        tiered, rows = tier_model(work.model, placement=placement)
        ModelRepository(hot_repo).publish(MODEL, tiered, shards=1, remote_rows=rows)
        configs = [("local", ROOT, local_repo, 0), ("hot", ROOT, hot_repo, 1)]
        if mine.baseline_tree:
            configs.append(("hot, baseline tree", mine.baseline_tree.resolve(), hot_repo, 1))
        targets = []
        for name, tree, repo, embed in configs:
            running = up.enter_context(
                cluster_from(tree, repo, embed, tmp / name.replace(" ", "-").replace(",", ""), args)
            )
            address = running.router.address
            checks = check_equal(address, work, work.users[: args.check_users])
            results["checks"] += [{"system": name, **c} for c in checks]
            pids = {p.name: p.pid for p in running.processes}
            targets.append(({"system": name}, address, pids))
            print(f"{name}: up at {address}, checks {checks}", flush=True)
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            loadgen_pid = pool.submit(ready).result()
            if mine.embedding_core:
                processes = [(n, p) for _, _, pids in targets for n, p in pids.items()]
                results["pinned"] = embedding_core(processes, [os.getpid(), loadgen_pid])
            results["load"] = load_cases(targets, work, pool, loadgen_pid, args, mine.rounds)
    print("\n| filter | C | round | system | q/s | p50 ms | p99 ms | CPU ms/request (servers) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["load"]:
        cpu = r["cpu_ms_per_request"]["servers"]
        print(
            f"| {r['filter']} | {r['concurrency']} | {r['round']} | {r['system']} | "
            f"{r['qps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{cpu if cpu is None else f'{cpu:.2f}'} |"
        )
    results["ratios"] = ratios_to_local(results["load"])
    print("\n| filter | C | system | p50 ÷ local, median (each round) | q/s ÷ local, median |")
    print("|---|---|---|---|---|")
    for r in results["ratios"]:
        each = ", ".join(f"{x:.2f}" for x in r["p50_each"])
        print(
            f"| {r['filter']} | {r['concurrency']} | {r['system']} | "
            f"**{r['p50']:.2f}** ({each}) | {r['qps']:.2f} |"
        )
    args_out = mine.out
    args_out.parent.mkdir(parents=True, exist_ok=True)
    args_out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args_out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
