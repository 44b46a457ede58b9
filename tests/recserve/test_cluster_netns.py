"""Faults a network makes, on a cluster whose every process has a host of its own
(``recserve cluster up --hosts netns --network dc``): a router, two document shards of two
replicas each, each replica on its own host, every host behind its relay. Each test names its
bound; none waits longer than it must, and the cluster and its hosts are removed at the end,
also when a test fails.

* a shard partitioned (both its replicas' links down) under load: every answer OK, the partial
  ones name exactly that shard and hold the other shard's right top-K, each within the shard
  deadline + :data:`SLACK_S`; whole and right again within :data:`HEAL_S` of the heal;
* a replica whose host flaps (link down and up): every answer whole and right, its twin answers;
* a loss and jitter spike (``bad`` on every host): no wrong answer, every call within its bound;
* a client that sends half a request and vanishes: the router serves everyone else as before;
* shard 1 cut off from the router twice while live updates stream through it: no update
  applied on a subset, none acknowledged and lost, the shard caught up after each heal.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from recserve.cluster import Cluster
from recserve.cluster_hosts import set_link, set_network
from recserve.hosts.relay import PROFILES, profile_named
from retrieval.live_updates import RemoveItems, apply_update
from serving.live.update_log import log_path, read_log
from serving.protos import admin_pb2 as pb
from serving.protos import admin_pb2_grpc, recommend_pb2_grpc, shard_pb2, shard_pb2_grpc
from serving.repository.repository import ModelRepository
from support.cluster_load import USERS, Answer, Load
from support.netns_hosts import needs_namespaces, netns_cluster, recserve
from support.waiting import wait_until

pytestmark = [needs_namespaces, pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(300)]
DEADLINE_MS = 300.0
SLACK_S = 0.05
"""An answer ends within its shard deadline and this: the tower, the merge, the relays' hops."""
HEAL_S = 12.0
"""Whole again after a heal within the longest ejection back-off (``eject_max_ms``) and a
little: a replica that failed its calls is probed once its back-off ends."""
SHARD_1 = ("shard-1-0", "shard-1-1")


@pytest.fixture(scope="module")
def cluster(tiny, tmp_path_factory):
    """(tiny, cluster folder): 2 shards x 2 replicas, no embedding server, updates on."""
    root = tmp_path_factory.mktemp("netns")
    repo = ModelRepository(root / "repo")
    repo.publish("demo", tiny.model, shards=2)
    with netns_cluster(
        repo.root, root, "--shards", "2", "--replicas", "2", "--embedding-servers", "0",
        "--shard-deadline-ms", str(DEADLINE_MS), "--state-dir", str(root / "state"),
    ) as d:  # fmt: skip
        yield tiny, d


def load(cluster, **kw) -> Load:
    tiny, d = cluster
    return Load(Cluster.load(d).router.reach, tiny, tiny.model, shards=2, **kw)


def describe(answers: list[Answer]) -> str:
    lat = sorted(a.latency for a in answers)
    return (
        f"{len(answers)} answers, {sum(a.partial for a in answers)} partial, "
        f"p50 {lat[len(lat) // 2] * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms"
    )


def test_a_partitioned_shard_makes_answers_partial_naming_it_then_whole_after_the_heal(cluster):
    _, d = cluster
    with load(cluster) as run:
        assert run.wait_whole(30) is not None
        cut = time.monotonic()
        for name in SHARD_1:
            set_link(d, name, up=False)
        try:
            run.wait_count(10, 30)
            partial_seen = time.monotonic()
            while sum(a.partial for a in run.between(cut, time.monotonic())) < 5:
                assert time.monotonic() - partial_seen < 30, "no partial answers"
                time.sleep(0.05)
        finally:
            healed = time.monotonic()
            for name in SHARD_1:
                set_link(d, name, up=True)
        whole_at = run.wait_whole(HEAL_S + 10)
    during = run.between(cut, healed)
    print(f"partitioned: {describe(during)}; whole {whole_at and whole_at - healed:.2f} s after")
    assert all(a.code == "OK" for a in during), {a.code for a in during}
    assert all(a.right for a in during), [a for a in during if not a.right][:3]
    assert {a.missing for a in during if a.partial} == {("shard-1",)}
    assert all(a.missing == () for a in during if not a.partial)
    assert max(a.latency for a in during) <= DEADLINE_MS / 1000 + SLACK_S
    assert whole_at is not None and whole_at - healed <= HEAL_S


def test_a_replica_whose_host_flaps_leaves_every_answer_whole(cluster):
    _, d = cluster
    with load(cluster) as run:
        assert run.wait_whole(30) is not None
        start = time.monotonic()
        for _ in range(5):  # 5 flaps of 0.3 s down, 0.3 s up
            set_link(d, "shard-0-1", up=False)
            time.sleep(0.3)
            set_link(d, "shard-0-1", up=True)
            time.sleep(0.3)
        end = time.monotonic()
    during = run.between(start, end)
    print(f"flapping: {describe(during)}")
    assert during and all(a.code == "OK" and not a.partial and a.right for a in during)
    assert max(a.latency for a in during) <= DEADLINE_MS / 1000 + SLACK_S


def test_a_loss_and_jitter_spike_gives_no_wrong_answer_and_no_hang(cluster):
    _, d = cluster
    with load(cluster) as run:
        assert run.wait_whole(30) is not None
        start = time.monotonic()
        set_network(d, profile_named("bad"))
        try:
            run.wait_count(40, 60)
        finally:
            set_network(d, PROFILES["dc"])
            end = time.monotonic()
        whole_at = run.wait_whole(HEAL_S + 10)
    during = run.between(start, end)
    print(f"bad network: {describe(during)}")
    assert all(a.code == "OK" and a.right for a in during), {(a.code, a.right) for a in during}
    # a stalled segment on the client's own link (the router's relay) delays the call itself
    # by its retransmission timeout; the shards' stalls are cut by the deadline
    stall = profile_named("bad").stall_ms / 1000
    assert max(a.latency for a in during) <= DEADLINE_MS / 1000 + 2 * stall + SLACK_S
    assert whole_at is not None


def test_a_client_that_sends_half_a_request_and_vanishes_changes_nothing(cluster):
    _, d = cluster
    router = Cluster.load(d).router
    with load(cluster) as run:
        assert run.wait_whole(30) is not None
        start = time.monotonic()
        for address in (router.reach, router.address):  # through the relay and past it
            host, port = address.rsplit(":", 1)
            for _ in range(20):
                c = socket.create_connection((host, int(port)), timeout=5)
                # the HTTP/2 preface and half of a HEADERS frame header, then gone
                c.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x40\x01")
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                c.close()
        run.wait_count(20, 30)
        end = time.monotonic()
    during = run.between(start, end)
    print(f"half requests: {describe(during)}")
    assert all(a.code == "OK" and not a.partial and a.right for a in during)
    assert max(a.latency for a in during) <= DEADLINE_MS / 1000 + SLACK_S


def test_cluster_net_and_link_change_a_running_clusters_network(cluster):
    _, d = cluster
    bad = recserve("cluster", "net", "bad", "--host", "shard-0-0", "--directory", str(d))
    assert bad.returncode == 0, bad.stderr
    profile = json.loads((d / "net" / "shard-0-0.json").read_text())
    assert profile == profile_named("bad").to_json()
    assert json.loads((d / "net" / "shard-1-0.json").read_text()) == PROFILES["dc"].to_json()
    back = recserve("cluster", "net", "dc", "--directory", str(d))
    assert back.returncode == 0, back.stderr
    assert json.loads((d / "net" / "shard-0-0.json").read_text()) == PROFILES["dc"].to_json()
    wrong = recserve("cluster", "net", "lossy", "--directory", str(d))
    assert wrong.returncode == 2 and "one of ['bad', 'dc', 'none', 'zone']" in wrong.stderr
    nosuch = recserve("cluster", "link", "shard-9-9", "down", "--directory", str(d))
    assert nosuch.returncode == 2 and "no host 'shard-9-9'" in nosuch.stderr
    up = recserve("cluster", "link", "shard-0-0", "up", "--directory", str(d))
    assert up.returncode == 0, up.stderr


def replica_sequences(cluster: Cluster, version: int) -> dict[str, int | None]:
    """Shard replica name -> the live updates it applied to ``version`` (None: no answer)."""
    out: dict[str, int | None] = {}
    for p in cluster.processes:
        if p.role != "shard":
            continue
        with grpc.insecure_channel(p.address) as channel:
            try:
                info = shard_pb2_grpc.ShardStub(channel).Info(shard_pb2.InfoRequest(), timeout=5)
            except grpc.RpcError:
                out[p.name] = None
                continue
        out[p.name] = dict(zip(info.versions, info.sequences, strict=True)).get(version)
    return out


def test_a_shard_cut_off_during_live_updates_leaves_none_half_applied_nor_lost(cluster):
    """Removals back to back through the router while shard 1's hosts are cut off twice, each
    time mid-stream: whatever phase an update was in, afterwards every replica holds exactly
    the logged updates, every acknowledged one is logged, every refused one is not, and the
    answers are the unsharded model's with the logged removals. Runs last: it changes the
    model the other tests check answers against."""
    tiny, d = cluster
    running = Cluster.load(d)
    version = running.version
    admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel(running.router.reach))
    want = tiny.expected(tiny.model, np.arange(USERS), 10)[0]
    victims = list(dict.fromkeys(int(i) for i in want.reshape(-1)))[:40]
    outcome: dict[str, str] = {}  # update_id -> OK / the status name
    spans: list[tuple[float, float]] = []  # each update's call: (start, end)
    cuts: list[tuple[float, float]] = []
    stop = threading.Event()

    def remove(item: int) -> str:
        try:
            request = pb.RemoveItemsRequest(ids=[item], update_id=f"remove-{item}")
            admin.RemoveItems(request, timeout=3)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    def updates() -> None:
        for item in victims:
            if stop.is_set():
                return
            start = time.monotonic()
            outcome[f"remove-{item}"] = remove(item)
            spans.append((start, time.monotonic()))

    thread = threading.Thread(target=updates)
    thread.start()
    try:
        # 1 s: the calls in flight wait, TCP retransmits, they go through; 3.5 s: longer than
        # a call's prepare window, so the one in flight is refused or committed without shard 1
        for seconds in (1.0, 3.5):
            wait_until(lambda n=len(outcome) + 3: len(outcome) >= n, 30, "updates answered")
            start = time.monotonic()
            for name in SHARD_1:
                set_link(d, name, up=False)
            time.sleep(seconds)
            for name in SHARD_1:
                set_link(d, name, up=True)
            cuts.append((start, time.monotonic()))
    finally:
        for name in SHARD_1:
            set_link(d, name, up=True)
        stop.set()
        thread.join(120)
    print(f"updates: { {c: list(outcome.values()).count(c) for c in set(outcome.values())} }")
    assert all(any(a < start < b for a, b in spans) for start, _ in cuts), "no cut mid-update"
    path = log_path(d.parent / "state", "demo", version)
    names = [pb.LogRecord.FromString(r).update_id for r in read_log(path).records]
    assert len(names) == len(set(names)), "an update logged twice"
    assert {n for n, c in outcome.items() if c == "OK"} <= set(names), "acknowledged, not logged"
    refused = {n for n, c in outcome.items() if c == "UNAVAILABLE"}
    assert not refused & set(names), "refused, yet logged"
    assert set(outcome.values()) <= {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, outcome
    # the client retries what it does not know went through: each is applied once
    for item in victims[: len(outcome)]:
        if outcome[f"remove-{item}"] != "OK":
            assert remove(item) == "OK"
    logged = [pb.LogRecord.FromString(r) for r in read_log(path).records]
    assert sorted(r.update_id for r in logged) == sorted(outcome)
    # every replica catches up to the log, none past it (HEAL_S: the sync loop and a back-off)
    wait_until(
        lambda: set(replica_sequences(running, version).values()) == {len(logged)},
        HEAL_S + 10,
        "every replica at the log's last update",
    )
    model = tiny.model
    removed = torch.tensor([i for r in logged for i in r.remove_items.ids])
    model = apply_update(copy.deepcopy(model), RemoveItems(removed))
    after = tiny.expected(model, np.arange(USERS), 10)[0]
    stub = recommend_pb2_grpc.RecommenderStub(grpc.insecure_channel(running.router.reach))

    def whole_and_right() -> bool:
        replies = [stub.Recommend(tiny.message(u, 10), timeout=5) for u in range(USERS)]
        return all(
            not r.partial and list(r.item_ids) == after[u].tolist() for u, r in enumerate(replies)
        )

    wait_until(whole_and_right, HEAL_S, "the answers of the model with the logged removals")
