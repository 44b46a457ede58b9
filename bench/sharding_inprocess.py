"""bench/sharding.py's in-process cases, where no process boundary is crossed: the unsharded
forward (the cost of a request with no serving), the router's forward with its shards searched
in this thread (split + merge, wire encoding, no gRPC), and a router ``Server`` over in-process
shard servers (batcher and loopback gRPC, no front-end gRPC)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sharding_workload import MODEL, Workload
from timing import OtherLoad, time_batched, time_single

from retrieval.index.ivf import IVFIndex
from serving.app.config import BatchingConfig, RouterConfig, ServeConfig
from serving.app.server import Server
from serving.protos import shard_pb2 as shard_pb
from serving.repository.repository import ModelRepository
from serving.sharding.router import RouterRunner
from serving.sharding.shard_server import ShardServer
from serving.sharding.wire import decode_request, encode_response
from serving.types import RecRequest

# ---- statistics ---------------------------------------------------------------------------------


def single_latency(fn: Callable[[int], object], n: int) -> dict[str, float]:
    """p50/p99 of ``fn(i)`` over ``n`` one-request calls (``bench/timing.py``'s ``time_single``)."""
    p50, p99 = time_single(fn, n=n)
    return {"p50_ms": p50, "p99_ms": p99}


# ---- 1. in-process, unsharded -------------------------------------------------------------------
def inprocess_cases(work: Workload, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Single-user latency and batched throughput of ``model(batch, k)``: no serving at all."""
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
    published queue delay and again with none (what the batcher's wait costs one request;
    skipped when the published delay is already none)."""
    repo = ModelRepository(root)
    servers = [ShardServer(repo, MODEL, s, poll_s=0) for s in range(shards)]
    rows = []
    try:
        addresses = [[s.start()] for s in servers]
        rows += _router_latency(root, addresses, None, shards, work, args)  # config.pbtxt's
        if rows[0]["queue_delay_ms"] > 0:
            rows += _router_latency(root, addresses, 0.0, shards, work, args)
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
