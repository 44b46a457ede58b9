"""Live updates through the router over real processes (issue 18): a local cluster with an update
log on the router takes upserts, removals and eligibility flips through the router's Admin API;
kill -9 of a shard server and of the router loses none of them (the restarted shard is caught up
from the router's log, the restarted router replays it), and the answers stay those of the
unsharded model with the same updates. A shard frozen whole (SIGSTOP of both its replicas)
during an update makes the router refuse it within its prepare deadline, and nothing of it is
applied once the shard resumes; a retry with the same update_id applies it once. An upsert of
item 2**62 is refused naming its field, and logged nowhere."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
import torch

from recserve.cluster import Cluster
from retrieval.live_updates import RemoveItems, SetItemAttributes, UpsertItems, apply_update
from serving.live.update_log import log_path, read_log
from serving.protos import admin_pb2 as pb
from serving.protos import admin_pb2_grpc, recommend_pb2_grpc, shard_pb2, shard_pb2_grpc
from serving.repository.repository import ModelRepository
from serving.sharding.config import RouterConfig
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


PREPARE_S = RouterConfig.model_fields["update_prepare_ms"].default / 1000.0
SLACK_S = 8.0
"""The update's Info round (2 s) and a busy machine."""


@contextmanager
def frozen(procs: list) -> Iterator[None]:
    """SIGSTOPs ``procs`` for the block; always SIGCONTs them."""
    stopped = []
    try:
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
            stopped.append(p)
        yield
    finally:
        for p in stopped:
            os.kill(p.pid, signal.SIGCONT)


def shard_stubs(cluster: Cluster) -> dict[str, shard_pb2_grpc.ShardStub]:
    """Shard server name -> a stub of its ``Shard`` service."""
    return {
        p.name: shard_pb2_grpc.ShardStub(grpc.insecure_channel(p.address))
        for p in cluster.processes
        if p.role == "shard"
    }


def replica_sequences(stubs: dict[str, shard_pb2_grpc.ShardStub], version: int) -> dict:
    """Shard server name -> the live updates it has applied to ``version`` (None: no answer)."""
    out: dict[str, int | None] = {}
    for name, stub in stubs.items():
        try:
            info = stub.Info(shard_pb2.InfoRequest(), timeout=5)
        except grpc.RpcError:
            out[name] = None
            continue
        out[name] = dict(zip(info.versions, info.sequences, strict=True)).get(version)
    return out


def holds(predicate, seconds: float, what: str) -> None:
    """``predicate`` stays true for ``seconds`` (polled every 0.2 s)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert predicate(), what
        time.sleep(0.2)


def router_log(cluster: Cluster) -> str:
    router = cluster.router
    with open(router.log, "rb") as f:
        f.seek(router.log_offset)
        return f.read().decode(errors="replace")


def test_a_frozen_shard_refuses_an_update_and_a_retry_applies_it_once(tiny, tmp_path):
    repo = ModelRepository(tmp_path / "repo")
    version = repo.publish("demo", tiny.model, shards=2)
    d, state = tmp_path / "run", tmp_path / "state"
    up = recserve(
        "cluster", "up", "--model-repo", str(repo.root), "--shards", "2", "--replicas", "2",
        "--embedding-servers", "0", "--directory", str(d), "--state-dir", str(state),
    )  # fmt: skip
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        cluster = Cluster.load(d)
        admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel(cluster.router.address))
        shards = shard_stubs(cluster)
        before = answers(cluster, tiny)
        assert not any(partial for _, partial in before)
        victim = before[1][0][0]  # user 1's first item
        request = pb.RemoveItemsRequest(ids=[victim], update_id="remove-victim")
        shard_1 = [p for p in cluster.processes if p.name.startswith("shard-1-")]
        with frozen(shard_1):
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                admin.RemoveItems(request, timeout=WAIT)
            took = time.monotonic() - start
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "no replica of shard 1" in err.value.details()
        assert took < PREPARE_S + SLACK_S, took

        # resumed, the frozen replicas run what was queued (the prepare, its abort): no effect
        everywhere = dict.fromkeys(shards, 0)
        wait_until(
            lambda: replica_sequences(shards, version) == everywhere,
            timeout_s=WAIT,
            what="every replica answers again",
        )
        holds(
            lambda: replica_sequences(shards, version) == everywhere,
            3.0,
            "a replica applied the refused update after it resumed",
        )
        assert len(read_log(log_path(state, "demo", version)).records) == 0
        wait_until(  # whole again once the resumed replicas are back in rotation
            lambda: answers(cluster, tiny) == before, timeout_s=WAIT, what="the same answers"
        )

        reply = admin.RemoveItems(request, timeout=WAIT)  # the client's retry: applied now
        assert reply.sequence == 1
        assert admin.RemoveItems(request, timeout=WAIT) == reply  # and once
        assert len(read_log(log_path(state, "demo", version)).records) == 1
        wait_until(
            lambda: replica_sequences(shards, version) == {n: 1 for n in everywhere},
            timeout_s=WAIT,
            what="every replica at update 1",
        )
        after = answers(cluster, tiny)
        assert all(victim not in ids for ids, _ in after)

        # one replica frozen while an update goes through: the update does not wait out the
        # prepare deadline for it, and the router logs no false "beyond the log" error
        with frozen([p for p in cluster.processes if p.name == "shard-0-1"]):
            start = time.monotonic()
            second = admin.RemoveItems(
                pb.RemoveItemsRequest(ids=[after[2][0][0]], update_id="second"), timeout=WAIT
            )
            took = time.monotonic() - start
            assert second.sequence == 2
            assert took < PREPARE_S, took
        wait_until(
            lambda: replica_sequences(shards, version) == {n: 2 for n in everywhere},
            timeout_s=WAIT,
            what="the resumed replica caught up from the router's log",
        )
        text = router_log(cluster)
        assert "beyond this router's log" not in text
        assert "replica 127.0.0.1" in text and "caught up" in text
    finally:
        down = recserve("cluster", "down", "--directory", str(d))
        assert down.returncode == 0, down.stderr
