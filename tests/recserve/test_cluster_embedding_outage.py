"""`recserve cluster up` with the user tables on the embedding server and the item table in the
router (the demo's placement): kill -9 of the embedding server leaves every answer OK and equal
to the answer before, because the router holds the small user tables whole
(``router.embedding_hold_bytes``, ``sharded_tables/remote/held.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch

from recserve.cluster import Cluster
from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel, table_specs
from retrieval.tiering import tier_model
from retrieval.training.prepare import prepare
from serving.protos import recommend_pb2_grpc
from serving.repository.repository import ModelRepository
from sharded_tables.placement import Budgets
from sharded_tables.specs import DType, Tier
from support.tiny_model import Tiny

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(300)]
OUTAGE_S = 3.0  # calls sent back to back after the kill


def recserve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(tiny helper, cluster dir): INT8 tables, the item table in the router's host tier, every
    other table on the one embedding server."""
    root = tmp_path_factory.mktemp("outage")
    ds = generate(SyntheticConfig(num_users=64, num_items=2000, seed=5))
    prep = prepare(ds, history_len=8)
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, prep.dataset.item_attributes)
    item = next(s for s in table_specs(model.config, DType.INT8) if s.name == "item")
    budgets = Budgets(
        device=0, host=int(item.bytes(DType.INT8) * 1.01), remote_per_server=64 << 20,
        remote_servers=1,
    )  # fmt: skip
    tiered, rows = tier_model(model.eval(), budgets, dtype=DType.INT8)
    remote = {p.table for p in tiered.tables.plan.tables if p.tier is Tier.REMOTE}
    assert "item" not in remote and {f"user_{n}" for n in prep.config.user_features} <= remote
    ModelRepository(root / "repo").publish("demo", tiered, shards=1, remote_rows=rows)
    d = root / "run"
    up = recserve(
        "cluster", "up", "--model-repo", str(root / "repo"), "--shards", "1",
        "--embedding-servers", "1", "--directory", str(d), "--router-processes", "1",
    )  # fmt: skip
    assert up.returncode == 0, up.stderr + up.stdout
    yield Tiny(prep, tiered), d
    recserve("cluster", "down", "--directory", str(d))


def test_a_killed_embedding_server_leaves_every_answer_whole(cluster):
    tiny, d = cluster
    running = Cluster.load(d)
    embed = next(p for p in running.processes if p.name == "embed-0")
    with grpc.insecure_channel(running.router.address) as channel:
        stub = recommend_pb2_grpc.RecommenderStub(channel)
        msgs = [tiny.message(u, 10) for u in range(8)]
        before = [list(stub.Recommend(m, timeout=10).item_ids) for m in msgs]
        os.kill(embed.pid, signal.SIGKILL)
        codes: dict[str, int] = {}
        wrong, calls, until = 0, 0, time.monotonic() + OUTAGE_S
        while time.monotonic() < until:
            i = calls % len(msgs)
            try:
                ids = list(stub.Recommend(msgs[i], timeout=10).item_ids)
                codes["OK"] = codes.get("OK", 0) + 1
                wrong += ids != before[i]
            except grpc.RpcError as e:
                codes[e.code().name] = codes.get(e.code().name, 0) + 1
            calls += 1
    assert embed_gone(embed.pid)
    assert codes == {"OK": calls} and wrong == 0, (codes, wrong)
    assert calls >= 5 and all(len(b) == 10 for b in before) and np.unique(before).size > 10
    print(f"embedding server killed: {calls} calls, {codes}, {wrong} differ from before")


def embed_gone(pid: int) -> bool:
    """Whether ``pid`` is no longer a running process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].startswith("Z")
    except FileNotFoundError:
        return True
