"""A slow embedding host, over a real network: a cluster on namespaced hosts (``--hosts netns
--network dc``: router, 1 shard, 1 embedding server holding the item table, too big for the
router to hold whole) whose embedding host's link turns slow (round trips longer than the
router's embedding timeout). Every call ends within the timeout's bound: UNAVAILABLE or
DEADLINE_EXCEEDED when it needs the slow host's rows, else OK and right; never a hang, never a
wrong answer. Back at ``dc`` rows no cache holds come again."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch

from recserve.cluster import Cluster
from recserve.cluster_hosts import set_network
from recserve.hosts.relay import PROFILES, Profile
from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.tiering import tier_model
from retrieval.training.prepare import prepare
from serving.protos import recommend_pb2_grpc
from serving.repository.repository import ModelRepository
from serving.sharding.config import RouterConfig
from sharded_tables.placement import Budgets
from sharded_tables.specs import DType, Tier
from support.netns_hosts import needs_namespaces, netns_cluster
from support.tiny_model import Tiny

pytestmark = [needs_namespaces, pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(300)]
TIMEOUT_S = RouterConfig.model_fields["embedding_timeout_ms"].default / 1000
SLOW = Profile(delay_ms=400.0, jitter_ms=50.0)
"""Round trips of 0.7-0.9 s: past the router's embedding timeout."""
BOUND_S = 2 * TIMEOUT_S + 0.25
"""A call may wait for one failing batch ahead of it (``test_cluster.py``'s bound)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("netns-embed")
    ds = generate(SyntheticConfig(num_users=64, num_items=12_000, seed=3))
    prep = prepare(ds, history_len=8)
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, prep.dataset.item_attributes)
    budgets = Budgets(device=0, host=1 << 20, remote_per_server=64 << 20, remote_servers=1)
    tiered, rows = tier_model(model.eval(), budgets, dtype=DType.FP32)
    assert any(p.tier is Tier.REMOTE for p in tiered.tables.plan.tables)
    repo = ModelRepository(root / "repo")
    repo.publish("demo", tiered, shards=1, remote_rows=rows)
    with netns_cluster(
        repo.root, root, "--shards", "1", "--embedding-servers", "1", "--shard-threads", "1"
    ) as d:
        yield model.eval(), Tiny(prep, model), d


def call(stub, msg) -> tuple[str, float, list[int]]:
    start = time.monotonic()
    try:
        ids = list(stub.Recommend(msg, timeout=10).item_ids)
        code = "OK"
    except grpc.RpcError as e:
        ids, code = [], e.code().name
    return code, time.monotonic() - start, ids


def test_a_slow_embedding_host_fails_fast_and_never_wrong(cluster):
    model, tiny, d = cluster
    running = Cluster.load(d)
    stub = recommend_pb2_grpc.RecommenderStub(grpc.insecure_channel(running.router.reach))
    users = np.arange(8)
    want = tiny.expected(model, users, 20)[0]
    for u in users:  # right at dc (and their rows offered to the router's cache)
        code, _, ids = call(stub, tiny.message(int(u), 20))
        assert (code, ids) == ("OK", want[u].tolist())
    rng = np.random.default_rng(0)
    set_network(d, SLOW, ["embed-0"])
    try:
        fresh, cached = [], []
        for i in range(12):  # bounded: 12 fresh and 12 cached calls
            msg = tiny.message(i % 8, 20)
            msg.history[:] = rng.integers(0, model.config.num_items, len(msg.history)).tolist()
            fresh.append(call(stub, msg))
            code, latency, ids = call(stub, tiny.message(i % 8, 20))
            cached.append((code, latency, ids == want[i % 8].tolist()))
    finally:
        set_network(d, PROFILES["dc"], ["embed-0"])
    codes = {c for c, _, _ in fresh + cached}
    worst = max(x[1] for x in fresh + cached)
    counts = {c: [x[0] for x in fresh + cached].count(c) for c in sorted(codes)}
    print(f"slow embedding host: {counts} over 24 calls, max {worst:.2f} s")
    assert codes <= {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, codes
    assert codes - {"OK"}, "no call needed the slow host's rows"
    assert worst < BOUND_S
    assert all(right for c, _, right in cached if c == "OK"), "an OK answer was wrong"
    deadline = time.monotonic() + 30
    while True:  # back at dc: fresh rows come again
        msg = tiny.message(0, 20)
        msg.history[:] = rng.integers(0, model.config.num_items, len(msg.history)).tolist()
        if call(stub, msg)[0] == "OK":
            break
        assert time.monotonic() < deadline, "fresh rows never came back after the network did"
