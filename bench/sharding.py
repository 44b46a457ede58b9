"""Document-sharding benchmark: the router + shard servers against the unsharded model, one run.

One synthetic catalog (``--items``, default 200k; ``--small``: 20k) and one model (untrained
weights, real IVF index). Measured, in this order, on the same requests:

* in-process, unsharded: ``model(batch, k)`` -- single-user latency (p50/p99 over many calls)
  and batched throughput (``--batch`` users per call). Every ratio divides by these.
* per shard count S (``--shards``), the version published with ``shards=S``:

  - local merge: the router's own ``RouterRunner.forward`` with the S shard indexes called in
    this thread (wire encoding included, no gRPC): the cost of splitting and merging;
  - in-process router: S ``ShardServer`` and a router ``Server`` in this process, requests
    through its batcher (``state.recommend``), shards over loopback gRPC (as
    ``tests/serving/sharding/test_router.py``);
  - the real serving path: ``recserve cluster up --shards S`` (router and S shard servers as
    processes on 127.0.0.1), gRPC ``Recommend`` from a load generator in a separate process,
    closed loop with C clients (``--concurrency``) for ``--seconds``: q/s, p50, p99, partial
    answers and errors (both must be 0); once per S, the routed answers of a few users are
    checked against the in-process forward (ids equal, scores within 1e-4);
  - ``recserve cluster down`` in a ``finally``; at the end no shard server of this run is left
    (``pgrep -f "recserve serve shard"``).

Each case runs unfiltered and with ``--filter``. The router, the S shard processes and the load
generator share this machine's cores: on a small machine the numbers show sharding's overhead,
not its scale-out.

Run from the repository root::

    .venv/bin/python bench/sharding.py --small        # 20k items, ~2.5 min
    .venv/bin/python bench/sharding.py                # 200k items, ~4 min on 2 cores

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
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen import closed_loop, ready
from server_procs import processes_mentioning
from sharding_report import SCORE_ATOL, add_ratios, render
from timing import OtherLoad, int_list, time_batched, time_single

from recserve.cluster import Cluster
from retrieval.data import SyntheticConfig, generate
from retrieval.features import UserBatch
from retrieval.index.ivf import IVFIndex
from retrieval.model import RetrievalModel
from retrieval.training.prepare import Prepared, prepare
from serving.app.config import BatchingConfig, RouterConfig, ServeConfig
from serving.app.server import Server
from serving.protos import recommend_pb2, recommend_pb2_grpc
from serving.protos import shard_pb2 as shard_pb
from serving.repository.repository import ModelRepository
from serving.sharding.router import RouterRunner
from serving.sharding.shard_server import ShardServer
from serving.sharding.wire import decode_request, encode_response
from serving.types import RecRequest

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench"
NO_FILTER = "none"
SHARD_SERVER_PATTERN = "recserve serve shard"


# ---- arguments ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="20k items, shorter cases (quick check)")
    p.add_argument("--items", type=int, help="catalog size (default 200k, 20k with --small)")
    p.add_argument("--users", type=int, default=2000, help="synthetic users")
    p.add_argument("--request-users", type=int, default=256, help="distinct users in requests")
    p.add_argument("--shards", type=int_list, default=[1, 2, 4], help="shard counts, e.g. 1,2,4")
    p.add_argument(
        "--concurrency", type=int_list, default=[1, 8], help="closed-loop clients, e.g. 1,8"
    )
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
        "--no-inprocess-router", action="store_true", help="skip the in-process router case"
    )
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="per `cluster up`")
    p.add_argument("--out", type=Path, help="JSON results (default bench/results/sharding*.json)")
    args = p.parse_args(argv)
    args.items = args.items or (20_000 if args.small else 200_000)
    args.seconds = args.seconds or (3.0 if args.small else 8.0)
    if args.out is None:
        name = "sharding_small.json" if args.small else "sharding.json"
        args.out = ROOT / "bench" / "results" / name
    if args.k > args.items:
        p.error(f"--k {args.k}: must be <= --items {args.items}")
    if args.request_users > args.users or args.check_users > args.request_users:
        p.error("need --check-users <= --request-users <= --users")
    return args


# ---- the workload -------------------------------------------------------------------------------
@dataclass
class Workload:
    """The model, its data and the requests every case sends."""

    prep: Prepared
    model: RetrievalModel
    users: np.ndarray
    """Users of the requests, cycled through in order."""
    k: int
    filters: dict[str, str | None]
    """Label -> filter text (None: unfiltered)."""

    def batch(self, users: np.ndarray, label: str) -> UserBatch:
        """The in-process input of ``users``, all with the filter ``label``."""
        return self.prep.user_batch(users, [self.filters[label]] * len(users))

    def request(self, user: int, label: str) -> RecRequest:
        """What the server makes of a ``Recommend`` call (as ``tests/support/serving_fixtures.py``)."""
        ds, cfg = self.prep.dataset, self.prep.config
        hist = self.prep.history[user]
        return RecRequest(
            history=hist[hist >= 0].astype(np.int64),
            categorical=np.array([ds.user_features[n][user] for n in cfg.user_features], np.int64),
            dense=ds.user_dense[user].astype(np.float32),
            k=self.k,
            filter=self.filters[label],
        )

    def message(self, user: int, label: str) -> recommend_pb2.RecommendRequest:
        """The gRPC ``Recommend`` request of ``user``."""
        r = self.request(user, label)
        return recommend_pb2.RecommendRequest(
            user_id=str(user),
            history=r.history.tolist(),
            categorical=r.categorical.tolist(),
            dense=r.dense.tolist(),
            k=self.k,
            filter=r.filter or "",
        )

    def expected(self, users: np.ndarray, label: str) -> tuple[np.ndarray, np.ndarray]:
        """In-process unsharded answer of ``users`` -> (ids, scores)."""
        with torch.inference_mode():
            ids, scores = self.model(self.batch(users, label), self.k)
        return ids.numpy(), scores.numpy()


def build_workload(args: argparse.Namespace) -> Workload:
    """Synthetic catalog -> prepared data -> model with its index (untrained weights)."""
    ds = generate(SyntheticConfig(num_users=args.users, num_items=args.items, seed=3))
    prep = prepare(ds)
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, prep.dataset.item_attributes)
    return Workload(
        prep,
        model.eval(),
        np.arange(args.request_users),
        args.k,
        {NO_FILTER: None, args.filter: args.filter},
    )


def environment(work: Workload) -> dict[str, Any]:
    """Machine, versions and the index's shape, recorded with the numbers."""
    idx = work.model.index
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpc": grpc.__version__,
        "items": idx.ntotal,
        "dim": idx.dim,
        "nlist": idx.nlist,
        "nprobe": idx.config.nprobe,
        "codes": idx.config.codes,
        "other_load_at_start": _idle_other_load(),
    }


def _idle_other_load(seconds: float = 1.0) -> float:
    """Share of the machine's CPU that other processes used over ``seconds`` before the run."""
    load = OtherLoad()
    load.start()
    time.sleep(seconds)
    return load.stop()


# ---- statistics ---------------------------------------------------------------------------------


def single_latency(fn: Callable[[int], object], n: int) -> dict[str, float]:
    """p50/p99 of ``fn(i)`` over ``n`` one-request calls (``bench/timing.py``'s ``time_single``)."""
    p50, p99 = time_single(fn, n=n)
    return {"p50_ms": p50, "p99_ms": p99}


# ---- 1. in-process, unsharded -------------------------------------------------------------------
def inprocess_cases(work: Workload, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The baseline: single-user latency and batched throughput of ``model(batch, k)``."""
    rows = []
    n_users = len(work.users)
    big = np.resize(work.users, args.batch)
    for label in work.filters:
        singles = [work.batch(work.users[i : i + 1], label) for i in range(n_users)]
        batch = work.batch(big, label)
        load = OtherLoad()
        load.start()
        with torch.inference_mode():
            lat = single_latency(
                lambda i, s=singles: work.model(s[i % n_users], work.k), args.single
            )
            _, median_s, _ = time_batched(lambda b=batch: work.model(b, work.k), repeats=5)
        rows.append(
            {
                "filter": label,
                **lat,
                "batched_qps": args.batch / median_s,
                "batch": args.batch,
                "other_load": load.stop(),
            }
        )
        print(json.dumps({"case": "in-process", **rows[-1]}))
    return rows


# ---- 2a. local merge: RouterRunner.forward with the shards in this thread -----------------------
class LocalShards:
    """Stands in for :class:`serving.sharding.shard_client.ShardClient`: the same ``search``
    contract, each shard searched in turn in this thread, request and answers serialized and
    parsed as on the wire (no gRPC, no threads)."""

    def __init__(self, shards: list[IVFIndex], version: int):
        self.shards, self.version = shards, version
        self.num_shards = len(shards)

    def timeout(self, deadline: float | None) -> float:
        return 60.0

    def search(
        self, request: shard_pb.SearchRequest, timeout: float, skip: set[int]
    ) -> tuple[dict[int, shard_pb.SearchResponse], dict[int, str]]:
        wire = request.SerializeToString()
        answers = {}
        for s, index in enumerate(self.shards):
            if s in skip:
                continue
            q, fb, plan = decode_request(shard_pb.SearchRequest.FromString(wire))
            cand = index.item_candidates(q, fb, plan, with_vectors=request.with_vectors)
            reply = encode_response(s, self.version, cand).SerializeToString()
            answers[s] = shard_pb.SearchResponse.FromString(reply)
        return answers, {}


def local_merge_cases(
    repo: ModelRepository, version: int, shards: int, work: Workload, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Latency of the router's forward with its shards searched locally (split + merge cost)."""
    router_model = repo.load(MODEL, version).model
    indexes = [repo.load_shard(MODEL, version, s)[0] for s in range(shards)]
    runner = RouterRunner(router_model, MODEL, version, LocalShards(indexes, version))  # type: ignore[arg-type]
    rows = []
    for label in work.filters:
        singles = [work.batch(work.users[i : i + 1], label) for i in range(len(work.users))]
        n = len(singles)
        with torch.inference_mode():
            lat = single_latency(
                lambda i, s=singles, n=n: runner.forward(s[i % n], work.k, None), args.single
            )
        rows.append({"shards": shards, "filter": label, **lat})
        print(json.dumps({"case": "local merge", **rows[-1]}))
    return rows


# ---- 2b. in-process router: ShardServers + router Server in this process ------------------------
def inprocess_router_cases(
    root: Path, shards: int, work: Workload, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Latency of ``state.recommend`` on a router in this process over in-process shard servers
    (batcher and loopback gRPC to the shards; no front-end gRPC, no process boundary), with the
    published queue delay and again with none (what the batcher's wait costs one request)."""
    repo = ModelRepository(root)
    servers = [ShardServer(repo, MODEL, s, poll_s=0) for s in range(shards)]
    rows = []
    try:
        addresses = [[s.start()] for s in servers]
        for delay_ms in (None, 0.0):  # None: the model's config.pbtxt
            rows += _router_latency(root, addresses, delay_ms, shards, work, args)
    finally:
        for s in servers:
            s.stop(0)
    return rows


def _router_latency(
    root: Path,
    addresses: list[list[str]],
    delay_ms: float | None,
    shards: int,
    work: Workload,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """One in-process router ``Server`` (queue delay ``delay_ms``): p50/p99 per filter."""
    cfg = ServeConfig(
        model_repo=root,
        model=MODEL,
        grpc_port=0,
        poll_s=0,
        router=RouterConfig(shards=addresses, shard_deadline_ms=args.shard_deadline_ms),
        batching=BatchingConfig(max_queue_delay_ms=delay_ms),
    )
    router = Server(cfg)
    rows = []
    try:
        router.start()
        state = router.state
        if state is None:
            raise RuntimeError("in-process router: no serving state after start()")
        delay = state.batcher.policy.max_queue_delay_s * 1e3
        for label in work.filters:
            reqs = [work.request(int(u), label) for u in work.users]
            partial = 0

            def call(i: int, reqs: list[RecRequest] = reqs) -> None:
                nonlocal partial
                partial += int(state.recommend(reqs[i % len(reqs)], timeout=60).partial)

            lat = single_latency(call, args.single)
            row = {"shards": shards, "filter": label, "queue_delay_ms": delay, **lat}
            rows.append({**row, "partial": partial})
            print(json.dumps({"case": "in-process router", **rows[-1]}))
    finally:
        router.drain_and_stop(timeout=5)
    return rows


# ---- 2c. the real serving path: `recserve cluster up` -------------------------------------------
def recserve(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@contextmanager
def cluster(
    repo_root: Path, shards: int, directory: Path, args: argparse.Namespace
) -> Iterator[str]:
    """``recserve cluster up`` -> the router's gRPC address; always ``cluster down`` after, and
    any process of this cluster still alive then (found by its unique repository path) is
    signalled by pid."""
    try:
        up = recserve(
            "cluster", "up", "--model-repo", str(repo_root), "--model", MODEL,
            "--shards", str(shards), "--embedding-servers", "0",
            "--shard-deadline-ms", str(args.shard_deadline_ms), "--directory", str(directory),
            timeout=args.startup_timeout_s,
        )  # fmt: skip
        if up.returncode != 0:
            raise RuntimeError(
                f"`recserve cluster up --shards {shards}` failed ({up.returncode}):\n"
                f"{up.stderr}{up.stdout}"
            )
        yield Cluster.load(directory).router.address
    finally:
        if (directory / "cluster.json").exists():
            down = recserve("cluster", "down", "--directory", str(directory), timeout=120)
            if down.returncode != 0:
                print(f"cluster down: {down.stderr}{down.stdout}", file=sys.stderr)
        stop_pids(processes_mentioning(str(repo_root)))


def stop_pids(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM each pid, SIGKILL those alive after ``grace_s`` (only this run's processes)."""
    if not pids:
        return
    print(f"stopping leftover processes {pids}", file=sys.stderr)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        until = time.monotonic() + grace_s
        while time.monotonic() < until and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.1)


def check_equal(address: str, work: Workload, users: np.ndarray) -> list[dict[str, Any]]:
    """Routed answers of ``users`` vs the in-process forward, for every filter."""
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = recommend_pb2_grpc.RecommenderStub(channel)
        for label in work.filters:
            want_ids, want_scores = work.expected(users, label)
            got = [stub.Recommend(work.message(int(u), label), timeout=60) for u in users]
            ids = np.array([list(r.item_ids) for r in got])
            scores = np.array([list(r.scores) for r in got], dtype=np.float32)
            ids_equal = ids.shape == want_ids.shape and bool((ids == want_ids).all())
            fin = np.isfinite(want_scores)
            same_inf = scores.shape == want_scores.shape and bool(
                (np.isfinite(scores) == fin).all()
            )
            diff = float(np.abs(scores[fin] - want_scores[fin]).max()) if same_inf else float("inf")
            out.append(
                {
                    "filter": label,
                    "users": len(users),
                    "ids_equal": ids_equal,
                    "max_score_diff": diff,
                    "partial": sum(r.partial for r in got),
                    "equal": ids_equal and diff <= SCORE_ATOL and not any(r.partial for r in got),
                }
            )
    return out


def run_load(
    address: str, payloads: list[bytes], concurrency: int, warmup_s: float, seconds: float
) -> dict[str, Any]:
    """The load generator process: ``Recommend`` in a closed loop (``bench/loadgen.py``)."""
    return closed_loop(
        address,
        lambda channel: recommend_pb2_grpc.RecommenderStub(channel).Recommend,
        [recommend_pb2.RecommendRequest.FromString(b) for b in payloads],
        concurrency,
        warmup_s,
        seconds,
        partial=lambda response: bool(response.partial),
    )


def cluster_cases(
    address: str,
    shards: int,
    work: Workload,
    pool: ProcessPoolExecutor,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Every (filter, concurrency) load case against a running cluster."""
    rows = []
    for label in work.filters:
        payloads = [work.message(int(u), label).SerializeToString() for u in work.users]
        for c in args.concurrency:
            got = pool.submit(run_load, address, payloads, c, args.warmup_s, args.seconds).result()
            rows.append({"shards": shards, "concurrency": c, "filter": label, **got})
            print(json.dumps({"case": "cluster", **rows[-1]}))
    return rows


# ---- one shard count ----------------------------------------------------------------------------
def shard_count_cases(
    shards: int, tmp: Path, work: Workload, pool: ProcessPoolExecutor, args: argparse.Namespace
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
    started = time.perf_counter()
    with cluster(root, shards, tmp / f"cluster-{shards}", args) as address:
        startup_s = time.perf_counter() - started
        print(f"cluster with {shards} shards up in {startup_s:.1f} s at {address}")
        checks = check_equal(address, work, work.users[: args.check_users])
        for c in checks:
            print(json.dumps({"case": "check", "shards": shards, **c}))
        out["checks"] = [{"shards": shards, "startup_s": startup_s, **c} for c in checks]
        out["cluster"] = cluster_cases(address, shards, work, pool, args)
    return out


def leftover_shard_servers(marker: str) -> dict[str, list[int]]:
    """``pgrep -f "recserve serve shard"``: this run's (must be none) and others' pids."""
    found = subprocess.run(["pgrep", "-f", SHARD_SERVER_PATTERN], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    ours = set(processes_mentioning(marker))
    return {"ours": [p for p in pids if p in ours], "others": [p for p in pids if p not in ours]}


# ---- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    work = build_workload(args)
    env = environment(work)
    print(f"{args.items:,} items, K={args.k}, model built in {time.perf_counter() - t0:.1f} s")
    print(json.dumps(env))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results: dict[str, Any] = {"config": config, "environment": env}
    spawn = multiprocessing.get_context("spawn")
    with (
        tempfile.TemporaryDirectory(prefix="recserve-sharding-") as tmp,
        ProcessPoolExecutor(1, mp_context=spawn) as pool,
    ):
        pool.submit(ready).result()  # the load generator process exists before any timing
        results["inprocess"] = inprocess_cases(work, args)
        try:
            for s in args.shards:
                for kind, rows in shard_count_cases(s, Path(tmp), work, pool, args).items():
                    results.setdefault(kind, []).extend(rows)
        finally:
            results["leftover_shard_servers"] = leftover_shard_servers(tmp)
    add_ratios(results)
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
