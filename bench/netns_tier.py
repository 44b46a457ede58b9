"""The remote tier against local tables across namespaced hosts: Recommend through the router
with the model's coldest tables on an embedding server of its own host, against the same model
with every table local to the router, each network profile on every host.

Two clusters up at once (``recserve cluster up --hosts netns --network NETWORK --shards 1``),
from one synthetic catalog and model (``bench/sharding_workload.py``, untrained by default):

* ``local``: ``--embedding-servers 0``, every table in the router's host tier;
* ``remote``: ``--embedding-servers 1`` and, with ``--tables item`` (the default), the item
  table (the hottest and largest: ``history_len`` ids a user) on the embedding server, read
  through the router's hot-row cache at its default size and never copied whole
  (``bench/remote_hot.py``'s budgets): a cache miss is a round trip router -> embedding host,
  through that host's relay, inside the Recommend. ``--tables coldest``: every other table
  there instead (``sharding_workload.publish_remote``), small enough that the router holds them
  whole (``router.embedding_hold_bytes``), so no request waits on that host.

One closed-loop load generator in a process of its own (``bench/loadgen.py``), the same requests,
concurrencies in turns (local at C, remote at C, local at the next C, ...). Printed per side and
C: q/s, p50, p99, refused calls; the verdicts p50 at 1 client remote / local (the remote tier's
target on 127.0.0.1 was <= 1.5x) and max q/s at p99 <= ``--p99-ms`` remote / local. Answers of
both are checked equal to the in-process model's for a few users first.

    .venv/bin/python bench/netns_tier.py --network dc      # ~3 min on 2 cores

Needs root (network namespaces). Writes ``--out`` (default ``bench/results/netns_tier_<network>.json``).
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen import ready
from netns_routed import check, load_in_turns, routed_on_hosts, verdict
from remote_hot import hot_item_budgets
from server_procs import ROOT
from sharding_workload import MODEL, NO_FILTER, Workload, build_workload, publish_remote

from recserve.hosts.netns import unavailable
from recserve.hosts.relay import profile_named
from retrieval.model import table_specs
from retrieval.tiering import tier_model
from serving.repository.repository import ModelRepository
from sharded_tables.planner import plan
from sharded_tables.specs import DType, Tier


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--network", default="dc", help="profile: none, dc, zone, bad")
    p.add_argument("--tables", default="item", choices=["item", "coldest"], help="remote ones")
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--users", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=0, help="0: untrained weights")
    p.add_argument("--request-users", type=int, default=256)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--concurrency", default="1,4,8", help="clients per case")
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds per case")
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--p99-ms", type=float, default=20.0)
    p.add_argument("--shard-deadline-ms", type=float, default=200.0)
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    a.filter = "category in {news, music}"  # build_workload's filtered label (unused here)
    tail = "" if a.tables == "item" else f"_{a.tables}"
    a.out = a.out or ROOT / "bench" / "results" / f"netns_tier{tail}_{a.network}.json"
    return a


def publish_tables(root: Path, work: Workload, tables: str) -> list[str]:
    """Publishes the ``remote`` side's version (1 shard, ``tables`` on one embedding server);
    returns the remote tables' names."""
    if tables == "coldest":
        remote: list[str] = publish_remote(root, work, shards=1)["remote_tables"]
        return remote
    placement = plan(table_specs(work.model.config, DType.FP32), hot_item_budgets(work))
    assert placement.placement("item").tier is Tier.REMOTE
    tiered, rows = tier_model(work.model, placement=placement)
    ModelRepository(root).publish(MODEL, tiered, shards=1, remote_rows=rows)
    return [p.table for p in placement.tables if p.tier is Tier.REMOTE]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"bench/netns_tier.py: {reason}")
    work = build_workload(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    payloads = work.payloads(NO_FILTER)
    tmp = Path(tempfile.mkdtemp(prefix="netns-tier-"))
    ModelRepository(tmp / "local").publish(MODEL, work.model, shards=1)
    remote_tables = publish_tables(tmp / "remote", work, args.tables)
    ctx = multiprocessing.get_context("spawn")
    with (
        ProcessPoolExecutor(1, mp_context=ctx) as pool,
        routed_on_hosts(tmp / "local", args.network, tmp / "run-local", args) as (local_at, lpid),
        routed_on_hosts(tmp / "remote", args.network, tmp / "run-remote", args, 1) as (
            remote_at,
            rpid,
        ),
    ):
        pool.submit(ready).result()
        for address in (local_at, remote_at):
            check(address, work)
        sides = [("local", local_at, lpid), ("remote", remote_at, rpid)]
        rows = load_in_turns(pool, sides, payloads, levels, args)
    best, p50, ratios = verdict(rows, "remote", "local", args.p99_ms)
    out = {
        "bench": "netns_tier",
        "meta": {
            "argv": list(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_avg": os.getloadavg(),
        },
        "network": args.network,
        "profile": profile_named(args.network).to_json(),
        "items": args.items,
        "k": args.k,
        "p99_ms": args.p99_ms,
        "shard_deadline_ms": args.shard_deadline_ms,
        "tables": args.tables,
        "remote_tables": remote_tables,
        "cpus": os.cpu_count(),
        "rows": rows,
        "max_qps": best,
        "p50_1_ms": p50,
        "verdict": ratios,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"\n{args.network}: p50 at 1 client remote/local {p50['remote']:.2f}/{p50['local']:.2f} ms"
        f" = {ratios['p50_1_ratio']:.2f}x ({ratios['p50_1_delta_ms']:+.2f} ms); max q/s at p99"
        f" <= {args.p99_ms:g} ms {best['remote']:.0f}/{best['local']:.0f} = "
        f"{ratios['max_qps_ratio'] or 0:.2f}x; {args.out}"
    )
    return out


if __name__ == "__main__":
    main()
