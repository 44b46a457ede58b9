"""Embedding servers follow publishes (issue 18), over real processes: a cluster serving version 1
with its item table on an embedding server gets version 2 published with different item rows;
without a restart the embedding server loads them beside version 1, the router switches when the
shards and the embedding server hold version 2, every answer during the switch is whole and equals
the unsharded model of the version that answered, and afterwards the answers are version 2's."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

from recserve.cluster import Cluster
from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.tiering import tier_model
from retrieval.training.prepare import prepare
from serving.protos import recommend_pb2_grpc
from serving.repository.repository import ModelRepository
from sharded_tables.placement import Budgets
from sharded_tables.remote.client import EmbeddingVersions
from sharded_tables.specs import DType, Tier
from support.tiny_model import Tiny
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(300)]
K, USERS = 20, 8
BUDGETS = Budgets(device=0, host=1 << 20, remote_per_server=64 << 20, remote_servers=1)


def recserve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args], capture_output=True, text=True, timeout=timeout
    )


def publish(repo: ModelRepository, model: RetrievalModel) -> None:
    tiered, rows = tier_model(model, BUDGETS, dtype=DType.FP32)
    assert any(p.tier is Tier.REMOTE for p in tiered.tables.plan.tables)  # the item table
    repo.publish("demo", tiered, shards=2, remote_rows=rows)


def test_embedding_servers_follow_a_publish_without_restart(tmp_path):
    ds = generate(SyntheticConfig(num_users=64, num_items=12_000, seed=3))
    prep = prepare(ds, history_len=8)
    tiny = Tiny(prep, RetrievalModel(prep.config))
    models = {1: tiny.build(seed=0), 2: tiny.build(seed=1)}  # other item rows, other answers
    users = np.arange(USERS)
    want = {v: tiny.expected(m, users, K)[0] for v, m in models.items()}
    assert not np.array_equal(want[1], want[2])
    repo = ModelRepository(tmp_path / "repo")
    publish(repo, models[1])
    d = tmp_path / "run"
    up = recserve(
        "cluster", "up", "--model-repo", str(repo.root), "--shards", "2",
        "--embedding-servers", "1", "--directory", str(d),
    )  # fmt: skip
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        cluster = Cluster.load(d)
        embed = next(p for p in cluster.processes if p.name == "embed-0")
        channel = grpc.insecure_channel(cluster.router.address)
        stub = recommend_pb2_grpc.RecommenderStub(channel)
        seen: list[tuple[int, str, bool, bool]] = []  # (version, status, partial, ids right)
        stop = threading.Event()

        def load() -> None:
            u = 0
            while not stop.is_set():
                try:
                    res = stub.Recommend(tiny.message(u % USERS, K), timeout=10)
                    right = res.version in want and (
                        list(res.item_ids) == want[res.version][u % USERS].tolist()
                    )
                    seen.append((res.version, "OK", res.partial, right))
                except grpc.RpcError as e:
                    seen.append((0, e.code().name, False, False))
                u += 1

        thread = threading.Thread(target=load)
        thread.start()
        try:
            wait_until(lambda: len(seen) >= 5, 60, "answers of version 1")
            publish(repo, models[2])
            wait_until(lambda: any(v == 2 for v, *_ in seen), 90, "the router serving version 2")
            switched = next(i for i, (v, *_) in enumerate(seen) if v == 2)
            wait_until(lambda: len(seen) >= switched + 2 * USERS, 60, "answers of version 2")
        finally:
            stop.set()
            thread.join(30)
        bad = [s for s in seen if s[1:] != ("OK", False, True)]
        assert not bad, f"{len(bad)} of {len(seen)} answers failed, partial or wrong: {bad[:5]}"
        assert {v for v, *_ in seen[switched:]} == {2}, "the router went back to version 1"
        assert {v for v, *_ in seen[:switched]} == {1}
        probe = EmbeddingVersions([embed.address])
        assert probe.held() == {1, 2}  # the same process: loaded beside version 1, no restart
        probe.close()
        channel.close()
        print(f"{len(seen)} answers, {switched} of version 1 before the switch; none failed")
    finally:
        recserve("cluster", "down", "--directory", str(d))
