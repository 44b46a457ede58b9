"""Routed against ``recserve serve`` across namespaced hosts with a network profile: what the
network costs the routed path, which pays two hops (client -> router, router -> shard) where
serve pays one.

Both run on hosts of their own (``recserve/hosts/``), each behind its host's relay with the same
profile (``--network``, default ``dc``): ``recserve serve model`` on one host; ``recserve
cluster up --hosts netns --shards 1 --embedding-servers 0`` (router and shard server on two
hosts; ``--replicas 2`` gives the shard a second replica on a third host, for the router's
hedge, ``--hedge-after-ms`` its delay, 0 adaptive). One synthetic catalog and model (``bench/sharding_workload.py``, untrained weights by
default: the network, not the model, is measured), the same requests, one closed-loop load
generator in a process of its own (``bench/loadgen.py``) on this machine, reaching each through
the bridge. Concurrencies in turns (serve at C, routed at C, serve at the next C, ...), since this
machine's speed drifts over minutes. Printed: per side q/s, p50, p99 at each C; the verdicts
max q/s at p99 <= ``--p99-ms`` routed / serve (target >= 0.75x at ``dc``) and p50 at 1 client
routed / serve and minus serve's. Every answer of both is checked equal to the in-process model
for a few users first.

    .venv/bin/python bench/netns_routed.py              # dc, 20k items, ~4 min on 2 cores
    .venv/bin/python bench/netns_routed.py --network none   # hosts, no relay: the baseline

Needs root (network namespaces). Writes ``--out`` (default ``bench/results/netns_<network>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from loadgen import ready
from server_procs import ROOT, Running, start, stop, wait_ready
from sharding_load import recserve, run_load
from sharding_workload import MODEL, NO_FILTER, Workload, build_workload

from recserve.cluster import Cluster
from recserve.hosts.netns import HostSet, unavailable
from recserve.hosts.relay import profile_named, write_profile
from serving.protos import recommend_pb2_grpc
from serving.repository.repository import ModelRepository


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--network", default="dc", help="profile: dc, zone, bad")
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--users", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=0, help="0: untrained weights")
    p.add_argument("--request-users", type=int, default=256)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--concurrency", default="1,2,4,8", help="clients per case")
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds per case")
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--p99-ms", type=float, default=20.0)
    p.add_argument("--shard-deadline-ms", type=float, default=200.0)
    p.add_argument("--replicas", type=int, default=1, help="routed: replicas of its one shard")
    p.add_argument("--hedge-after-ms", type=float, default=0.0, help="routed: 0 adaptive")
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    a.filter = "category in {news, music}"  # build_workload's filtered label (unused here)
    a.out = a.out or ROOT / "bench" / "results" / f"netns_{a.network}.json"
    return a


@contextmanager
def serve_on_host(repo: Path, network: str, logs: Path, args: argparse.Namespace):
    """``recserve serve model`` on a host of its own behind a relay with ``network``'s
    profile (``none``: no relay); yields (the address to call, the server's pid)."""
    with HostSet.create(["serve"]) as hosts:
        hosts.rate("serve", profile_named(network).rate or None)
        cmd = [*hosts.exec_prefix("serve"), sys.executable, "-m", "recserve", "serve", "model"]
        cmd += ["--model-repo", str(repo), "--model", MODEL, "--grpc-port", "0"]
        cmd += ["--host", hosts.ip("serve"), "--torch-threads", str(os.cpu_count() or 1)]
        server: Running | None = None
        relay: Running | None = None
        try:
            server = start(cmd, logs / "serve.log")
            wait_ready(server, args.startup_timeout_s)
            if network == "none":  # as the cluster: no relay without a profile
                yield server.address, server.proc.pid
                return
            profile_file = logs / "serve-net.json"
            write_profile(profile_file, profile_named(network))
            rcmd = [*hosts.exec_prefix("serve"), sys.executable, "-m", "recserve.hosts.relay"]
            rcmd += ["--host", hosts.ip("serve"), "--to", server.address]
            rcmd += ["--profile-file", str(profile_file)]
            relay = start(rcmd, logs / "serve-relay.log")
            wait_ready(relay, 60)
            yield relay.address, server.proc.pid
        finally:
            for r in (relay, server):
                if r is not None:
                    stop(r)


@contextmanager
def routed_on_hosts(
    repo: Path, network: str, d: Path, args: argparse.Namespace, embedding_servers: int = 0
):
    """``recserve cluster up --hosts netns --network NETWORK --shards 1``; yields (the router
    relay's address, the router's pid); always ``cluster down``."""
    up = recserve(
        "cluster", "up", "--model-repo", str(repo), "--model", MODEL, "--shards", "1",
        "--embedding-servers", str(embedding_servers), "--directory", str(d), "--hosts", "netns",
        "--network", network, "--shard-deadline-ms", str(args.shard_deadline_ms),
        "--replicas", str(getattr(args, "replicas", 1)),
        "--hedge-after-ms", str(getattr(args, "hedge_after_ms", 0.0)),
        timeout=args.startup_timeout_s,
    )  # fmt: skip
    try:
        if up.returncode != 0:
            raise RuntimeError(f"cluster up failed:\n{up.stderr}{up.stdout}")
        cluster = Cluster.load(d)
        yield cluster.router.reach, cluster.router.pid
    finally:
        if (d / "cluster.json").exists():
            recserve("cluster", "down", "--directory", str(d), timeout=120)


CHECK_TRIES = 3
"""Calls per checked user: a lossy profile may refuse one (a stall past the shard deadline),
which is no wrong answer."""


def check(address: str, work: Workload) -> None:
    """A few users' answers equal the in-process model's (ids)."""
    users = work.users[:4]
    want, _ = work.expected(users, NO_FILTER)
    with grpc.insecure_channel(address) as channel:
        stub = recommend_pb2_grpc.RecommenderStub(channel)
        for row, u in enumerate(users):
            for tries_left in range(CHECK_TRIES - 1, -1, -1):
                try:
                    reply = stub.Recommend(work.message(int(u), NO_FILTER), timeout=30)
                    break
                except grpc.RpcError as e:
                    if tries_left == 0 or e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
            got = list(reply.item_ids)
            if got != want[row].tolist():
                raise RuntimeError(f"{address}: user {u}'s answer differs from the model's")


def max_qps(rows: list[dict[str, Any]], p99_ms: float) -> float:
    fits = [r["qps"] for r in rows if r["p99_ms"] <= p99_ms and not r["errors"]]
    return max(fits, default=0.0)


def load_in_turns(
    pool: ProcessPoolExecutor,
    sides: list[tuple[str, str, int]],
    payloads: list[bytes],
    levels: list[int],
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    """Each ``(side, address, pid)`` loaded at every concurrency, the sides in turns per level
    -> side -> its rows (``run_load``'s, with ``concurrency``)."""
    rows: dict[str, list[dict[str, Any]]] = {side: [] for side, _, _ in sides}
    for c in levels:
        for side, address, pid in sides:
            r = pool.submit(
                run_load, address, payloads, c, args.warmup_s, args.seconds, {side: pid}
            ).result()
            r["concurrency"] = c
            rows[side].append(r)
            print(
                f"{side:6s} C={c}: {r['qps']:7.1f} q/s  p50 {r['p50_ms']:6.2f} ms  "
                f"p99 {r['p99_ms']:6.2f} ms  partial {r['partial']}  errors {r['errors']}",
                flush=True,
            )
    return rows


def verdict(
    rows: dict[str, list[dict[str, Any]]], side: str, base: str, p99_ms: float
) -> tuple[dict[str, float], dict[str, float], dict[str, float | None]]:
    """``side`` against ``base`` -> (max q/s at p99 <= ``p99_ms`` and p50 at one client, each
    side's; their ratios)."""
    p50 = {s: next(r["p50_ms"] for r in rows[s] if r["concurrency"] == 1) for s in (side, base)}
    best = {s: max_qps(rows[s], p99_ms) for s in (side, base)}
    return (
        best,
        p50,
        {
            "max_qps_ratio": best[side] / best[base] if best[base] else None,
            "p50_1_ratio": p50[side] / p50[base],
            "p50_1_delta_ms": p50[side] - p50[base],
        },
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"bench/netns_routed.py: {reason}")
    work = build_workload(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    payloads = work.payloads(NO_FILTER)
    tmp = Path(tempfile.mkdtemp(prefix="netns-bench-"))
    one, routed_repo = ModelRepository(tmp / "one"), ModelRepository(tmp / "routed")
    one.publish(MODEL, work.model)
    routed_repo.publish(MODEL, work.model, shards=1)
    (tmp / "logs").mkdir()
    ctx = multiprocessing.get_context("spawn")
    with (
        ProcessPoolExecutor(1, mp_context=ctx) as pool,
        serve_on_host(one.root, args.network, tmp / "logs", args) as (serve_at, serve_pid),
        routed_on_hosts(routed_repo.root, args.network, tmp / "run", args) as (
            routed_at,
            router_pid,
        ),
    ):
        pool.submit(ready).result()
        for address in (serve_at, routed_at):
            check(address, work)
        sides = [("serve", serve_at, serve_pid), ("routed", routed_at, router_pid)]
        rows = load_in_turns(pool, sides, payloads, levels, args)
    best, p50, ratios = verdict(rows, "routed", "serve", args.p99_ms)
    out = {
        "bench": "netns_routed",
        "meta": {
            "argv": list(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
        "network": args.network,
        "profile": profile_named(args.network).to_json(),
        "items": args.items,
        "k": args.k,
        "p99_ms": args.p99_ms,
        "shard_deadline_ms": args.shard_deadline_ms,
        "replicas": args.replicas,
        "hedge_after_ms": args.hedge_after_ms,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "rows": rows,
        "max_qps": best,
        "p50_1_ms": p50,
        "verdict": ratios,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"\n{args.network}: max q/s at p99 <= {args.p99_ms:g} ms routed/serve "
        f"{best['routed']:.0f}/{best['serve']:.0f} = {ratios['max_qps_ratio'] or 0:.2f}x "
        f"(target >= 0.75x); p50 at 1 client {p50['routed']:.2f}/{p50['serve']:.2f} ms = "
        f"{ratios['p50_1_ratio']:.2f}x ({ratios['p50_1_delta_ms']:+.2f} ms); {args.out}"
    )
    return out


if __name__ == "__main__":
    main()
