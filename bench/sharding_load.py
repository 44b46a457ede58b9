"""bench/sharding.py's production-path cases: ``recserve serve model`` (the unsharded baseline)
and ``recserve cluster up`` (router, shard servers, embedding servers) as processes on 127.0.0.1,
their answers checked against the in-process forward, and the closed-loop load generator
(``bench/loadgen.py``, a process of its own) driving both with the same requests at the same
concurrencies. Each load case also records the CPU every process spent in its measured window
(``/proc/<pid>/stat``) per answered request: on a few shared cores that is the figure that
scales, where q/s mostly shows who shares the cores."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from loadgen import closed_loop
from server_procs import Running, processes_mentioning, start, stop, wait_ready
from sharding_report import SCORE_ATOL
from sharding_workload import MODEL, NO_FILTER, Workload
from timing import OtherLoad

from recserve.cluster import Cluster, ClusterSpec, thread_split
from serving.protos import recommend_pb2, recommend_pb2_grpc, shard_pb2, shard_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
SHARD_SERVER_PATTERN = "recserve serve shard"


def cluster_threads(shards: int) -> int:
    """Torch threads ``recserve cluster up`` gives the router and, unless ``--shard-threads``
    says otherwise, each shard server (``recserve.cluster.thread_split``)."""
    return thread_split(ClusterSpec(Path("."), shards=shards), os.cpu_count() or 1)[0]


# ---- processes ----------------------------------------------------------------------------------
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
    repo_root: Path,
    shards: int,
    embedding_servers: int,
    directory: Path,
    args: argparse.Namespace,
) -> Iterator[Cluster]:
    """``recserve cluster up`` -> the running cluster (its processes, the router's address);
    always ``cluster down`` after, and any process of this cluster still alive then (found by
    its unique repository path) is signalled by pid."""
    try:
        up = recserve(
            "cluster", "up", "--model-repo", str(repo_root), "--model", MODEL,
            "--shards", str(shards), "--embedding-servers", str(embedding_servers),
            "--shard-deadline-ms", str(args.shard_deadline_ms), "--directory", str(directory),
            "--shard-threads", str(args.shard_threads),
            timeout=args.startup_timeout_s,
        )  # fmt: skip
        if up.returncode != 0:
            raise RuntimeError(
                f"`recserve cluster up --shards {shards} --embedding-servers "
                f"{embedding_servers}` failed ({up.returncode}):\n{up.stderr}{up.stdout}"
            )
        yield Cluster.load(directory)
    finally:
        if (directory / "cluster.json").exists():
            down = recserve("cluster", "down", "--directory", str(directory), timeout=120)
            if down.returncode != 0:
                print(f"cluster down: {down.stderr}{down.stdout}", file=sys.stderr)
        stop_pids(processes_mentioning(str(repo_root)))


@contextmanager
def serve_model(repo_root: Path, log: Path, args: argparse.Namespace) -> Iterator[Running]:
    """``recserve serve model`` (one process, ``--serve-threads`` torch threads) once ready;
    always stopped after."""
    cmd = [sys.executable, "-m", "recserve", "serve", "model", "--model-repo", str(repo_root)]
    cmd += ["--model", MODEL, "--grpc-port", "0", "--torch-threads", str(args.serve_threads)]
    if getattr(args, "device", "cpu") != "cpu":  # bench/timeline.py --device
        cmd += ["--device", args.device]
    run = start(cmd, log)
    try:
        wait_ready(run, args.startup_timeout_s)
        yield run
    finally:
        stop(run)


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


def leftover_shard_servers(marker: str) -> dict[str, list[int]]:
    """``pgrep -f "recserve serve shard"``: this run's (must be none) and others' pids."""
    found = subprocess.run(["pgrep", "-f", SHARD_SERVER_PATTERN], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    ours = set(processes_mentioning(marker))
    return {"ours": [p for p in pids if p in ours], "others": [p for p in pids if p not in ours]}


# ---- answers ------------------------------------------------------------------------------------
def only_ties_differ(ids: np.ndarray, want_ids: np.ndarray, want_scores: np.ndarray) -> bool:
    """``[B, K]`` answers differ only where neighbouring scores tie within ``SCORE_ATOL``: the
    order of tied items is arbitrary (shards merged, or a batch's matmul summing in another
    order, may order them another way)."""
    s = want_scores.astype(np.float64)
    step = s[:, :-1] - s[:, 1:]  # >= 0: best first
    inf = np.full((s.shape[0], 1), np.inf)
    tie = (np.concatenate([inf, step], 1) <= SCORE_ATOL) | (
        np.concatenate([step, inf], 1) <= SCORE_ATOL
    )
    return bool(tie[ids != want_ids].all())


def check_equal(address: str, work: Workload, users: np.ndarray) -> list[dict[str, Any]]:
    """Answers of the server at ``address`` for ``users`` vs the in-process forward, per filter."""
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = recommend_pb2_grpc.RecommenderStub(channel)
        for label in work.filters:
            want_ids, want_scores = work.expected(users, label)
            got = [stub.Recommend(work.message(int(u), label), timeout=60) for u in users]
            ids = np.array([list(r.item_ids) for r in got])
            scores = np.array([list(r.scores) for r in got], dtype=np.float32)
            ids_equal = ids.shape == want_ids.shape and bool((ids == want_ids).all())
            same_ids = ids_equal or (
                ids.shape == want_ids.shape and only_ties_differ(ids, want_ids, want_scores)
            )
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
                    "ids_equal_but_ties": same_ids,
                    "equal": same_ids and diff <= SCORE_ATOL and not any(r.partial for r in got),
                }
            )
    return out


# ---- load ---------------------------------------------------------------------------------------
SERVICES: dict[str, tuple[Any, Any]] = {  # name -> (channel -> unary method, request type)
    "recommend": (
        lambda channel: recommend_pb2_grpc.RecommenderStub(channel).Recommend,
        recommend_pb2.RecommendRequest,
    ),
    "search": (lambda channel: shard_pb2_grpc.ShardStub(channel).Search, shard_pb2.SearchRequest),
}


def run_load(
    address: str,
    payloads: list[bytes],
    concurrency: int,
    warmup_s: float,
    seconds: float,
    cpu_pids: dict[str, int],
    service: str = "recommend",
) -> dict[str, Any]:
    """The load generator process: ``Recommend`` (``service`` "recommend") or ``Shard.Search``
    ("search") in a closed loop (``bench/loadgen.py``), with the CPU of ``cpu_pids`` and of
    itself over the measured window."""
    send, message = SERVICES[service]
    return closed_loop(
        address,
        send,
        [message.FromString(b) for b in payloads],
        concurrency,
        warmup_s,
        seconds,
        partial=lambda response: bool(getattr(response, "partial", False)),
        cpu_pids=cpu_pids,
    )


def hop_floor_case(
    work: Workload, tmp: Path, pool: ProcessPoolExecutor, args: argparse.Namespace
) -> dict[str, Any]:
    """What the router's call to a shard costs with no search: the router's own ``Search``
    requests (one user each, unfiltered), one client, to a grpcio server that answers each
    with a fixed answer of a real one's size (``bench/serving_baselines.py noop-shard``). The
    routed p50 cannot beat serve's by less than this hop minus serve's own search."""
    payloads = work.search_payloads(NO_FILTER)
    width = shard_pb2.SearchRequest.FromString(payloads[0]).r
    cmd = [sys.executable, str(ROOT / "bench" / "serving_baselines.py"), "noop-shard"]
    run = start([*cmd, "--answer-width", str(width)], tmp / "noop-shard.log")
    try:
        wait_ready(run, args.startup_timeout_s)
        pids = {"noop-shard": run.proc.pid}
        got = pool.submit(
            run_load, run.address, payloads, 1, args.warmup_s, args.seconds, pids, "search"
        ).result()
    finally:
        stop(run)
    row = {"case": "hop floor", "filter": NO_FILTER, **got}
    row["cpu_ms_per_request"] = cpu_per_request(got["cpu_s"], round(got["qps"] * args.seconds))
    print(json.dumps(row), flush=True)
    return row


def cpu_per_request(cpu_s: dict[str, float | None], answered: int) -> dict[str, float | None]:
    """CPU ms per answered request of each process, and ``servers``: all but the load generator
    (None where a process's CPU is unknown or nothing was answered)."""
    out: dict[str, float | None] = {
        name: None if s is None or not answered else s * 1e3 / answered for name, s in cpu_s.items()
    }
    servers = [v for k, v in out.items() if k != "loadgen"]
    out["servers"] = None if not servers or None in servers else sum(servers)  # type: ignore[arg-type]
    return out


def load_cases(
    targets: list[tuple[dict[str, Any], str, dict[str, int]]],
    work: Workload,
    pool: ProcessPoolExecutor,
    loadgen_pid: int,
    args: argparse.Namespace,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Every (filter, concurrency) load case against each target ``(case, address, pids)``:
    ``case`` starts each row (what was measured), ``address`` is the server's, ``pids`` its
    processes (name -> pid). The targets take turns inside each (filter, concurrency) case, so
    a configuration and the serve run it is compared with are measured seconds apart (this
    machine's speed drifts by 1.5x over minutes: measured one after the other, the later
    system would pay for it). With ``rounds`` > 1 they take turns that many times per case,
    one row each (``round``)."""
    rows = []
    for label in work.filters:
        payloads = work.payloads(label)
        for c in args.concurrency:
            for r in range(rounds):
                for case, address, pids in targets:
                    load = OtherLoad({os.getpid(), loadgen_pid, *pids.values()})
                    load.start()
                    got = pool.submit(
                        run_load, address, payloads, c, args.warmup_s, args.seconds, pids
                    ).result()
                    answered = round(got["qps"] * args.seconds)
                    row = {**case, "concurrency": c, "filter": label, "round": r, **got}
                    row["cpu_ms_per_request"] = cpu_per_request(got["cpu_s"], answered)
                    rows.append({**row, "other_load": load.stop()})
                    print(json.dumps(rows[-1]), flush=True)
    return rows
