"""The demo's serving step: publish sharded -> local cluster -> Recommend and tritonclient calls.

The trained model is published with its catalog split into 2 document shards and its coldest
tables on 1 embedding server; ``recserve.cluster.up`` starts the embedding server, the two shard
servers and the router as real processes on 127.0.0.1 (``recserve cluster up`` runs the same
code); every call below goes over real gRPC sockets, and the cluster is stopped at the end. Then
the same INT8 rows, all local and unsharded, are served by one ``recserve serve`` process and
asked the same way, so the summary shows the router's latency beside one process's.
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as triton
from rich.console import Console
from rich.table import Table

from common.grpc_util import retry_options
from common.process import start
from recserve.cluster import ClusterSpec, down, up
from retrieval.model import RetrievalModel, table_specs
from retrieval.tiering import tier_model
from retrieval.training.prepare import Prepared
from serving.protos.recommend_pb2 import RecommendRequest, RecommendResponse
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository import ModelRepository
from serving.types import DATATYPES
from sharded_tables.export import RemoteRows
from sharded_tables.placement import Budgets
from sharded_tables.specs import DType

SHARDS, EMBEDDING_SERVERS = 2, 1


def tier_for_cluster(model: RetrievalModel) -> tuple[RetrievalModel, RemoteRows]:
    """INT8 tables; the host budget holds the hot item table, the colder ones go remote."""
    item = next(s for s in table_specs(model.config, DType.INT8) if s.name == "item")
    budgets = Budgets(
        device=0,
        host=int(item.bytes(DType.INT8) * 1.01),
        remote_per_server=64 << 20,
        remote_servers=EMBEDDING_SERVERS,
    )
    return tier_model(model, budgets, dtype=DType.INT8)


def _request(prep: Prepared, user: int, k: int, flt: str | None) -> RecommendRequest:
    batch = prep.user_batch(np.array([user]))
    return RecommendRequest(
        user_id=str(user),
        history=batch.history[0][batch.history[0] >= 0].tolist(),
        categorical=batch.categorical[0].tolist(),
        dense=batch.dense[0].tolist(),
        k=k,
        filter=flt or "",
    )


def serve_on_cluster(
    model: RetrievalModel,
    prep: Prepared,
    repo_dir: Path,
    cluster_dir: Path,
    name: str,
    users: np.ndarray,
    k: int,
    flt: str | None,
    console: Console,
    summary: dict[str, str],
) -> np.ndarray:
    """Publishes, starts the cluster, asks the router for every user's top-``k``, runs a short
    locust burst at it; returns the routed ids ``[U, k]`` (the cluster is down again when this
    returns). Adds its figures to ``summary``."""
    tiered, remote_rows = tier_for_cluster(model)
    remote = sorted(remote_rows)  # the tables the plan put on the embedding server
    repo = ModelRepository(repo_dir)
    version = repo.publish(name, tiered, shards=SHARDS, remote_rows=remote_rows)
    console.print(
        f"published {name} v{version}: {SHARDS} document shards, tables {remote} on "
        f"{EMBEDDING_SERVERS} embedding server ({repo.version_dir(name, version)})"
    )
    spec = ClusterSpec(
        model_repo=repo_dir, model=name, shards=SHARDS, embedding_servers=EMBEDDING_SERVERS
    )
    cluster = up(spec, cluster_dir, progress=lambda m: console.print(f"  {m}"))
    try:
        address = cluster.router.address
        # a client retries UNAVAILABLE (no shard answered in time: a busy machine's hiccup)
        with grpc.insecure_channel(address, options=retry_options()) as channel:
            stub = RecommenderStub(channel)
            replies = _recommend_all(stub, prep, users, k, console, summary)
            _show(stub, prep, int(users[0]), flt, console)
        _triton_call(address, name, prep, int(users[0]), console)
        _locust_burst(address, repo_dir, name, cluster_dir / "loadtest", console, summary)
    finally:
        down(cluster_dir)
        console.print("cluster down: every process stopped")
    _single_process(model, prep, repo_dir.parent / "model_repo_single", name, users, k, console,
                    summary)  # fmt: skip
    return np.array([list(r.item_ids) for r in replies])


def _single_process(
    model: RetrievalModel,
    prep: Prepared,
    repo_dir: Path,
    name: str,
    users: np.ndarray,
    k: int,
    console: Console,
    summary: dict[str, str],
) -> None:
    """The same INT8 rows in one ``recserve serve model`` process, asked the same way: its
    latency beside the router's, from the same run."""
    local, _ = tier_model(model, Budgets(device=0, host=1 << 40), dtype=DType.INT8)
    ModelRepository(repo_dir).publish(name, local)
    cmd = [sys.executable, "-m", "recserve", "serve", "model", "--model-repo", str(repo_dir),
           "--grpc-port", "0"]  # fmt: skip
    proc = start(cmd, log_path=repo_dir.parent / "serve-single.log", name="serve")
    try:
        address = proc.wait_ready(120.0).grpc
        with grpc.insecure_channel(address) as channel:
            _recommend_all(
                RecommenderStub(channel), prep, users, k, console, summary, "one process"
            )
    finally:
        proc.stop()


def _recommend_all(
    stub: RecommenderStub,
    prep: Prepared,
    users: np.ndarray,
    k: int,
    console: Console,
    summary: dict[str, str],
    via: str = "the router",
) -> list[RecommendResponse]:
    """Every user's Recommend, 8 in flight (the server batches them), through ``via``."""

    def call(u: int) -> tuple[RecommendResponse, float]:
        start = time.perf_counter()
        reply = stub.Recommend(_request(prep, u, k, None), timeout=10.0)
        return reply, time.perf_counter() - start

    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(call, users.tolist()))
    partial = sum(r.partial for r, _ in out)
    ms = sorted(t * 1e3 for _, t in out)
    p50, p99 = statistics.median(ms), ms[int(0.99 * (len(ms) - 1))]
    console.print(
        f"Recommend x{len(out)} via {via} (8 in flight): p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
        f"partial answers: {partial}"
    )
    summary[f"Recommend via {via}, 8 in flight"] = (
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, {partial} partial"
    )
    return [r for r, _ in out]


def _locust_burst(
    address: str, repo: Path, name: str, out: Path, console: Console, summary: dict[str, str]
) -> None:
    """5 s of locust gRPC users (Zipf users, varied K and filters) against the router."""
    from recserve.loadtest import LoadTestSpec, Thresholds, run

    spec = LoadTestSpec(address, "grpc", repo, name, users=8, spawn_rate=8, duration_s=5, out=out)
    s, found = run(spec, Thresholds(max_failure_ratio=0.0))
    line = (
        f"{s.requests} requests, {s.rps:.0f} req/s, p50 {s.p50_ms or 0:.0f} ms, "
        f"p99 {s.p99_ms or 0:.0f} ms, failures {s.failures}"
    )
    console.print(f"locust burst (8 users, 5 s, gRPC): {line}; plot: {out / 'latency.png'}")
    if found:
        console.print(f"[red]locust: {'; '.join(found)}")
    summary["locust burst against the router"] = line


def _show(
    stub: RecommenderStub, prep: Prepared, user: int, flt: str | None, console: Console
) -> None:
    ds = prep.dataset
    names = ds.display_names()
    reply = stub.Recommend(_request(prep, user, 8, flt), timeout=10.0)
    table = Table(title=f"router: user {user}" + (f" — filter: {flt}" if flt else ""))
    table.add_column("#", justify="right")
    table.add_column("recommended")
    table.add_column("score", justify="right")
    for rank, (i, s) in enumerate(zip(reply.item_ids, reply.scores, strict=True), 1):
        if i >= 0:
            table.add_row(str(rank), names[i], f"{s:.3f}")
    console.print(table)


def _triton_call(address: str, name: str, prep: Prepared, user: int, console: Console) -> None:
    """The same router through the unchanged Triton client (KServe v2 gRPC)."""
    req = _request(prep, user, 10, None)
    client = triton.InferenceServerClient(address)
    inputs = []
    for tensor, values in (
        ("history", np.array([list(req.history)], dtype=np.int64)),
        ("categorical", np.array([list(req.categorical)], dtype=np.int64)),
        ("dense", np.array([list(req.dense)], dtype=np.float32)),
        ("k", np.array([[10]], dtype=np.int32)),
    ):
        inputs.append(triton.InferInput(tensor, list(values.shape), DATATYPES[tensor]))
        inputs[-1].set_data_from_numpy(values)
    result = client.infer(name, inputs)
    console.print(
        f"tritonclient ModelInfer(user {user}, k=10) -> {result.as_numpy('item_ids')[0].tolist()}"
    )
    client.close()
