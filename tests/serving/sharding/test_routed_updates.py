"""Live updates through the router (serving/sharding/routed_updates.py), with real gRPC on
loopback (router and shard servers in this process): logged once on the router, applied to every
shard all or nothing, the router's statistics kept, replayed to a restarted shard and by a
restarted router, including one that stopped between its log and the shards' commit."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from retrieval.live_updates import RemoveItems, SetItemAttributes, UpsertItems, apply_update
from retrieval.model import RetrievalModel
from serving.app.config import RouterConfig, ServeConfig
from serving.app.server import Server
from serving.limits import LimitsConfig
from serving.live.messages import to_record
from serving.live.update_log import log_path, read_log
from serving.protos import admin_pb2 as pb
from serving.protos.admin_pb2_grpc import AdminStub
from serving.repository.repository import ModelRepository
from serving.sharding import routed_updates
from serving.sharding.shard_parts import PartRefusedError
from serving.sharding.shard_server import ShardServer
from support.topk_check import assert_same_topk
from support.waiting import wait_until

WAIT = 30
USERS = np.arange(6)
FILTERS = [None, "available"]


class Routed:
    """A 2-shard version of ``tiny``, its shard servers and a router with an update log."""

    def __init__(self, root: Path, model: RetrievalModel):
        self.root, self.state = root / "repo", root / "state"
        self.repo = ModelRepository(self.root)
        self.version = self.repo.publish("demo", model, shards=2)
        self.shards = [ShardServer(self.repo, "demo", s, poll_s=0) for s in range(2)]
        self.addresses = [s.start() for s in self.shards]
        self.router = self.start_router()

    def start_router(self, **router) -> Server:
        cfg = RouterConfig(
            shards=[[a] for a in self.addresses], shard_deadline_ms=10_000.0, **router
        )
        router = Server(
            ServeConfig(
                model_repo=self.root,
                model="demo",
                grpc_port=0,
                poll_s=0,
                router=cfg,
                state_dir=self.state,
            )
        )
        router.start()
        return router

    @property
    def admin(self) -> AdminStub:
        assert self.router.addresses is not None
        return AdminStub(grpc.insecure_channel(self.router.addresses.grpc))

    def restart_shard(self, s: int) -> None:
        self.shards[s].stop(0)
        port = int(self.addresses[s].rsplit(":", 1)[1])
        self.shards[s] = ShardServer(self.repo, "demo", s, poll_s=0, port=port)
        self.shards[s].start()

    def sequences(self) -> list[int]:
        return [s.parts.versions[self.version].sequence for s in self.shards]

    def results(self, tiny, k: int, text: str | None) -> list:
        assert self.router.state is not None
        futures = [self.router.state.submit(tiny.request(int(u), k, filter=text)) for u in USERS]
        return [f.result(timeout=WAIT) for f in futures]

    def answers(self, tiny, k: int, text: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        results = self.results(tiny, k, text)
        assert not any(r.partial for r in results)
        ids = torch.from_numpy(np.stack([r.item_ids for r in results]))
        return ids, torch.from_numpy(np.stack([r.scores for r in results]))

    def close(self) -> None:
        self.router.drain_and_stop(timeout=5)
        for s in self.shards:
            s.stop(0)


@pytest.fixture
def routed(tiny, tmp_path) -> Iterator[Routed]:
    r = Routed(tmp_path, tiny.model)
    yield r
    r.close()


def assert_answers_as(routed: Routed, tiny, model: RetrievalModel) -> None:
    wait_until(  # a replica ejected while it was down is back once a probe answers
        lambda: not any(r.partial for r in routed.results(tiny, 10, None)),
        timeout_s=WAIT,
        what="every shard answers",
    )
    for text in FILTERS:
        for k in (10, 200):
            ids, scores = routed.answers(tiny, k, text)
            want_ids, want_scores = tiny.expected(model, USERS, k, [text] * len(USERS))
            assert_same_topk(ids, scores, torch.from_numpy(want_ids), torch.from_numpy(want_scores))


def item(id_: int, vector: torch.Tensor | None = None, available: str = "true") -> pb.Item:
    attrs = [pb.Attribute(name="available", values=[available])]
    return pb.Item(id=id_, vector=[] if vector is None else vector.tolist(), attributes=attrs)


def send_all(stub: AdminStub, dim: int) -> list:
    """Four updates through ``stub`` -> the same updates as batches, for the unsharded model."""
    vec = torch.randn(2, dim, generator=torch.Generator().manual_seed(5)) * 2
    stub.UpsertItems(
        pb.UpsertItemsRequest(items=[item(500, vec[0]), item(501, vec[1])]), timeout=WAIT
    )
    stub.UpsertItems(pb.UpsertItemsRequest(items=[item(7, available="false")]), timeout=WAIT)
    stub.RemoveItems(pb.RemoveItemsRequest(ids=[3, 4, 501]), timeout=WAIT)
    stub.SetItemAttributes(
        pb.SetItemAttributesRequest(
            items=[
                pb.ItemAttributes(
                    id=9, attributes=[pb.Attribute(name="available", values=["false"])]
                )
            ]
        ),
        timeout=WAIT,
    )
    available = {"available": ("true",)}
    return [
        UpsertItems(torch.tensor([500, 501]), [available, available], vec),
        UpsertItems(torch.tensor([7]), [{"available": ("false",)}]),
        RemoveItems(torch.tensor([3, 4, 501])),
        SetItemAttributes(torch.tensor([9]), [{"available": ("false",)}]),
    ]


def updated(model: RetrievalModel, batches: list) -> RetrievalModel:
    model = copy.deepcopy(model)
    for b in batches:
        model = apply_update(model, b)
    return model


@pytest.mark.slow
def test_updates_through_the_router_answer_as_the_unsharded_model(routed, tiny):
    batches = send_all(routed.admin, tiny.model.index.dim)
    assert routed.sequences() == [4, 4]
    assert len(read_log(log_path(routed.state, "demo", routed.version)).records) == 4
    want = updated(tiny.model, batches)
    assert routed.router.host.current().model.index.ntotal == want.index.ntotal  # statistics
    assert_answers_as(routed, tiny, want)


@pytest.mark.slow
def test_an_update_a_shard_refuses_changes_nothing_anywhere(routed, tiny):
    admin = routed.admin
    with pytest.raises(grpc.RpcError) as err:  # item 3 is on a shard, item 9999 on none
        admin.RemoveItems(pb.RemoveItemsRequest(ids=[3, 9999]), timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ids[1]: item 9999 is not in the index" in err.value.details()
    routed.shards[1].stop(0)  # a shard down: no update can be whole
    with pytest.raises(grpc.RpcError) as err:
        admin.RemoveItems(pb.RemoveItemsRequest(ids=[3]), timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no replica of shard 1" in err.value.details()
    assert routed.shards[0].parts.versions[routed.version].sequence == 0
    assert read_log(log_path(routed.state, "demo", routed.version)).records == []
    routed.restart_shard(1)
    assert_answers_as(routed, tiny, tiny.model)


@pytest.mark.slow
def test_a_restarted_shard_is_caught_up_from_the_routers_log(routed, tiny):
    batches = send_all(routed.admin, tiny.model.index.dim)
    routed.restart_shard(0)  # loads the published version: update 0
    assert routed.shards[0].parts.versions[routed.version].sequence == 0
    wait_until(lambda: routed.sequences() == [4, 4], timeout_s=WAIT, what="the shard caught up")
    assert_answers_as(routed, tiny, updated(tiny.model, batches))


@pytest.mark.slow
def test_a_router_stopped_between_its_log_and_the_commit_completes_it_on_restart(
    routed, tiny, monkeypatch
):
    def crash_before_commit(self, *args):
        raise RuntimeError("router killed after its log, before the shards' commit")

    monkeypatch.setattr(routed_updates.RoutedUpdates, "_commit", crash_before_commit)
    routed.router.updates._stop.set()  # type: ignore[union-attr]  # no sync loop: it is "dead"
    with pytest.raises(grpc.RpcError):
        routed.admin.RemoveItems(pb.RemoveItemsRequest(ids=[3, 4]), timeout=WAIT)
    assert len(read_log(log_path(routed.state, "demo", routed.version)).records) == 1
    assert routed.sequences() == [0, 0]  # prepared, never committed
    monkeypatch.undo()
    routed.router.drain_and_stop(timeout=5)
    routed.router = routed.start_router()  # replays its log, then the shards'
    assert routed.sequences() == [1, 1]
    assert_answers_as(routed, tiny, updated(tiny.model, [RemoveItems(torch.tensor([3, 4]))]))


def test_add_seen_through_the_router_excludes_for_the_named_user(tiny, tmp_path):
    """The router holds the seen store (its shards count the record only): a request naming its
    user is answered like the unsharded model given the same pairs, after a router restart too."""
    from retrieval.live_updates import AddSeen

    model = tiny.with_seen_store()
    r = Routed(tmp_path, model)
    try:
        assert r.router.state is not None
        first = r.router.state.submit(tiny.request(2, 10, user=2)).result(timeout=WAIT)
        consumed = first.item_ids[:4].tolist()
        reply = r.admin.AddSeen(pb.AddSeenRequest(users=[2] * 4, items=consumed), timeout=WAIT)
        assert reply.sequence == 1 and r.sequences() == [1, 1]
        want = apply_update(
            copy.deepcopy(model), AddSeen(torch.full((4,), 2), torch.tensor(consumed))
        )
        batch = tiny.prep.user_batch(np.array([2]))
        batch.user = torch.tensor([2])
        with torch.inference_mode():
            want_ids, want_scores = want(batch, 10)
        for _ in range(2):  # before and after a router restart (the log replays)
            got = r.router.state.submit(tiny.request(2, 10, user=2)).result(timeout=WAIT)
            assert not set(got.item_ids.tolist()) & set(consumed)
            assert_same_topk(
                torch.from_numpy(got.item_ids[None]),
                torch.from_numpy(got.scores[None]),
                want_ids,
                want_scores,
            )
            r.router.drain_and_stop(timeout=5)
            r.router = r.start_router()
            assert r.router.state is not None
    finally:
        r.close()


@pytest.mark.slow
def test_a_retried_update_id_through_the_router_applies_once(routed, tiny):
    """The router's log keeps the id: a retry gets the logged reply (after a router restart
    too), and the shards see the update once."""
    request = pb.RemoveItemsRequest(ids=[3, 4], update_id="rm-3-4")
    first = routed.admin.RemoveItems(request, timeout=WAIT)
    assert (first.sequence, first.update_id) == (1, "rm-3-4")
    assert routed.admin.RemoveItems(request, timeout=WAIT) == first
    routed.router.drain_and_stop(timeout=5)
    routed.router = routed.start_router()
    assert routed.admin.RemoveItems(request, timeout=WAIT) == first
    assert routed.sequences() == [1, 1]
    assert len(read_log(log_path(routed.state, "demo", routed.version)).records) == 1
    assert_answers_as(routed, tiny, updated(tiny.model, [RemoveItems(torch.tensor([3, 4]))]))


@pytest.mark.slow
def test_a_shard_that_cannot_prepare_in_time_refuses_the_update_and_its_late_prepare(
    routed, tiny, monkeypatch
):
    """A shard stalled in its prepare (in-process stand-in for a frozen replica): the router
    answers UNAVAILABLE after update_prepare_ms, aborts, and the prepare that runs once the
    shard moves again is refused, so nothing is applied anywhere."""
    routed.router.drain_and_stop(timeout=5)
    routed.router = routed.start_router(update_prepare_ms=1000.0)
    parts = routed.shards[1].parts
    stalled, go_on = threading.Event(), threading.Event()
    prepare = parts.prepare

    late: list[BaseException | None] = []

    def stalled_prepare(*args):
        stalled.set()
        go_on.wait(WAIT)
        try:
            done = prepare(*args)
        except BaseException as e:
            late.append(e)
            raise
        late.append(None)
        return done

    monkeypatch.setattr(parts, "prepare", stalled_prepare)
    start = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as err:
            routed.admin.RemoveItems(pb.RemoveItemsRequest(ids=[3], update_id="rm"), timeout=WAIT)
        took = time.monotonic() - start
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no replica of shard 1" in err.value.details()
        assert took < 1.0 + 3.0  # the prepare deadline, and slack for a busy machine
        assert stalled.is_set()
        wait_until(lambda: len(parts._aborted) == 1, timeout_s=WAIT, what="the abort arrived")
    finally:
        go_on.set()
    wait_until(lambda: late, timeout_s=WAIT, what="the late prepare ran")
    assert isinstance(late[0], PartRefusedError) and late[0].code == "ABORTED"
    assert routed.sequences() == [0, 0]
    assert read_log(log_path(routed.state, "demo", routed.version)).records == []
    monkeypatch.undo()
    reply = routed.admin.RemoveItems(pb.RemoveItemsRequest(ids=[3], update_id="rm"), timeout=WAIT)
    assert reply.sequence == 1 and routed.sequences() == [1, 1]
    assert_answers_as(routed, tiny, updated(tiny.model, [RemoveItems(torch.tensor([3]))]))


def test_a_shard_commits_only_the_attempt_a_commit_names(routed):
    """Shard side: a prepare of an aborted attempt is refused (ABORTED); a commit naming another
    attempt than the pending one is refused; the named one commits, and again is a no-op."""
    parts, v = routed.shards[0].parts, routed.version
    record = to_record(RemoveItems(torch.tensor([3])), 1).SerializeToString()
    parts.prepare("demo", v, 1, record, "a")
    parts.abort(v, 1, "a")
    with pytest.raises(PartRefusedError) as err:
        parts.prepare("demo", v, 1, record, "a")  # late: after its abort
    assert err.value.code == "ABORTED"
    parts.prepare("demo", v, 1, record, "b")
    with pytest.raises(PartRefusedError) as err:
        parts.commit("demo", v, 1, "a")
    assert err.value.code == "FAILED_PRECONDITION"
    assert parts.sequences()[v] == 0
    parts.commit("demo", v, 1, "b")
    parts.commit("demo", v, 1, "b")  # a retried commit
    assert parts.sequences()[v] == 1


@pytest.mark.slow
def test_a_stalled_replica_does_not_hold_the_update_and_is_caught_up(tiny, tmp_path, monkeypatch):
    """Shard 1 has two replicas and one stalls in its prepare: once both shards have a prepared
    replica the update goes on (well before update_prepare_ms), the stalled one's late prepare is
    refused, and the sync loop catches it up from the log."""
    r = Routed(tmp_path, tiny.model)
    second = ShardServer(r.repo, "demo", 1, poll_s=0)
    try:
        second_address = second.start()
        r.router.drain_and_stop(timeout=5)
        cfg = RouterConfig(
            shards=[[r.addresses[0]], [r.addresses[1], second_address]],
            shard_deadline_ms=10_000.0,
            update_prepare_ms=20_000.0,
        )
        r.router = Server(
            ServeConfig(
                model_repo=r.root, model="demo", grpc_port=0, poll_s=0, router=cfg,
                state_dir=r.state,
            )
        )  # fmt: skip
        r.router.start()
        go_on, late = threading.Event(), []
        prepare = second.parts.prepare

        def stalled_prepare(*args):
            go_on.wait(WAIT)
            try:
                return prepare(*args)
            except PartRefusedError as e:
                late.append(e.code)
                raise

        monkeypatch.setattr(second.parts, "prepare", stalled_prepare)
        start = time.monotonic()
        try:
            reply = r.admin.RemoveItems(pb.RemoveItemsRequest(ids=[3]), timeout=WAIT)
            took = time.monotonic() - start
        finally:
            go_on.set()
        assert reply.sequence == 1 and r.sequences() == [1, 1]
        assert took < 10.0, took  # the prepare deadline is 20 s
        wait_until(lambda: late == ["ABORTED"], timeout_s=WAIT, what="the late prepare refused")
        monkeypatch.undo()
        wait_until(
            lambda: second.parts.sequences()[r.version] == 1,
            timeout_s=WAIT,
            what="the stalled replica caught up from the log",
        )
    finally:
        r.close()
        second.stop(0)


def test_the_router_refuses_item_ids_past_the_bound_before_any_shard_prepares(
    tiny, tmp_path, monkeypatch
):
    """The router and an unsharded server take the same item ids: below the catalog +
    ``limits.max_item_id_growth``. The last id taken is upserted and then named by a seen pair;
    an upsert of 2**62 and a seen pair naming it are refused on the router, naming the field and
    the bound, before any shard is asked to prepare, and nothing is logged for them."""
    r = Routed(tmp_path, tiny.with_seen_store())
    prepares: list[int] = []
    for shard in r.shards:
        prepare = shard.parts.prepare

        def counted(model, version, sequence, record, attempt="", prepare=prepare):
            prepares.append(sequence)
            return prepare(model, version, sequence, record, attempt)

        monkeypatch.setattr(shard.parts, "prepare", counted)
    try:
        admin, dim = r.admin, tiny.model.index.dim
        catalog, growth = tiny.model.config.num_items, LimitsConfig().max_item_id_growth
        last = catalog + growth - 1
        vec = torch.randn(dim, generator=torch.Generator().manual_seed(3))
        assert (
            admin.UpsertItems(pb.UpsertItemsRequest(items=[item(last, vec)]), timeout=WAIT).sequence
            == 1
        )
        assert admin.AddSeen(pb.AddSeenRequest(users=[2], items=[last]), timeout=WAIT).sequence == 2
        assert prepares == [1, 1, 2, 2]  # both shards, both updates
        bound = (
            f"item {1 << 62} is past the catalog's {catalog} items + {growth} "
            f"(limits.max_item_id_growth): ids up to {last} are taken"
        )
        huge = [
            (admin.UpsertItems, pb.UpsertItemsRequest(items=[item(1 << 62, vec)]), "items[0].id"),
            (admin.AddSeen, pb.AddSeenRequest(users=[2], items=[1 << 62]), "items[0]"),
        ]  # fmt: skip
        for call, request_, where in huge:
            with pytest.raises(grpc.RpcError) as err:
                call(request_, timeout=WAIT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == f"{where}: {bound}"
        assert prepares == [1, 1, 2, 2] and r.sequences() == [2, 2]
        assert len(read_log(log_path(r.state, "demo", r.version)).records) == 2
    finally:
        r.close()
