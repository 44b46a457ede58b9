"""Live updates through the router over real processes (issue 18): a local cluster with an update
log on the router takes upserts, removals and eligibility flips through the router's Admin API;
kill -9 of a shard server and of the router loses none of them (the restarted shard is caught up
from the router's log, the restarted router replays it), and the answers stay those of the
unsharded model with the same updates; an upsert of item 2**62 is refused naming its field, and
logged nowhere."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

from recserve.cluster import Cluster
from retrieval.live_updates import RemoveItems, SetItemAttributes, UpsertItems, apply_update
from serving.protos import admin_pb2 as pb
from serving.protos import admin_pb2_grpc, recommend_pb2_grpc
from serving.repository.repository import ModelRepository
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(300)]
K, USERS, WAIT = 20, 8, 30


def recserve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args], capture_output=True, text=True, timeout=timeout
    )


def answers(cluster: Cluster, tiny) -> list[tuple[list[int], bool]]:
    stub = recommend_pb2_grpc.RecommenderStub(grpc.insecure_channel(cluster.router.address))
    out = []
    for u in range(USERS):
        res = stub.Recommend(tiny.message(u, K), timeout=10)
        out.append((list(res.item_ids), res.partial))
    return out


def kill(cluster: Cluster, name: str) -> None:
    os.kill(next(p for p in cluster.processes if p.name == name).pid, signal.SIGKILL)


def test_updates_survive_kill_9_of_a_shard_and_of_the_router(tiny, tmp_path):
    repo = ModelRepository(tmp_path / "repo")
    repo.publish("demo", tiny.model, shards=2)
    d = tmp_path / "run"
    up = recserve(
        "cluster", "up", "--model-repo", str(repo.root), "--shards", "2",
        "--embedding-servers", "0", "--directory", str(d), "--state-dir", str(tmp_path / "state"),
    )  # fmt: skip
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        cluster = Cluster.load(d)
        admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel(cluster.router.address))
        with torch.inference_mode():
            q = tiny.model.user_vectors(tiny.prep.user_batch(np.arange(1)))[0]
        available = [pb.Attribute(name="available", values=["true"])]
        admin.UpsertItems(
            pb.UpsertItemsRequest(items=[pb.Item(id=900, vector=q.tolist(), attributes=available)]),
            timeout=WAIT,
        )
        huge = pb.Item(id=1 << 62, vector=q.tolist(), attributes=available)
        with pytest.raises(grpc.RpcError) as err:  # refused by the router: no shard prepares it
            admin.UpsertItems(pb.UpsertItemsRequest(items=[huge]), timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"items[0].id: item {1 << 62} is past the catalog")
        top = [i for i in answers(cluster, tiny)[1][0] if i != 900][:3]  # user 1's top 3
        admin.RemoveItems(pb.RemoveItemsRequest(ids=top[:2]), timeout=WAIT)
        off = [pb.Attribute(name="available", values=["false"])]
        admin.SetItemAttributes(
            pb.SetItemAttributesRequest(items=[pb.ItemAttributes(id=top[2], attributes=off)]),
            timeout=WAIT,
        )
        model = copy.deepcopy(tiny.model)
        for batch in (
            UpsertItems(torch.tensor([900]), [{"available": ("true",)}], q[None].clone()),
            RemoveItems(torch.tensor(top[:2])),
            SetItemAttributes(torch.tensor([top[2]]), [{"available": ("false",)}]),
        ):
            model = apply_update(model, batch)
        want = [row.tolist() for row in tiny.expected(model, np.arange(USERS), K)[0]]
        assert [ids for ids, _ in answers(cluster, tiny)] == want
        assert want[0][0] == 900 and top[0] not in want[1]

        kill(cluster, "shard-0-0")  # comes back at update 0: the router replays 3 updates to it
        restarted = recserve("cluster", "restart", "shard-0-0", "--directory", str(d))
        assert restarted.returncode == 0, restarted.stderr
        wait_until(
            lambda: answers(Cluster.load(d), tiny) == [(w, False) for w in want],
            timeout_s=WAIT,
            what="the restarted shard caught up from the router's log",
        )
        kill(Cluster.load(d), "router")  # replays its log: statistics, and nothing re-sent
        restarted = recserve("cluster", "restart", "router", "--directory", str(d))
        assert restarted.returncode == 0, restarted.stderr
        assert answers(Cluster.load(d), tiny) == [(w, False) for w in want]
        reply = admin_pb2_grpc.AdminStub(
            grpc.insecure_channel(Cluster.load(d).router.address)
        ).RemoveItems(pb.RemoveItemsRequest(ids=[900]), timeout=WAIT)
        assert (reply.sequence, reply.items) == (4, tiny.model.index.ntotal - 2)  # 2**62: unlogged
    finally:
        down = recserve("cluster", "down", "--directory", str(d))
        assert down.returncode == 0, down.stderr
