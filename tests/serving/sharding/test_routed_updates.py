"""Live updates through the router (serving/sharding/routed_updates.py), with real gRPC on
loopback (router and shard servers in this process): logged once on the router, applied to every
shard all or nothing, the router's statistics kept, replayed to a restarted shard and by a
restarted router, including one that stopped between its log and the shards' commit."""

from __future__ import annotations

import copy
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
from serving.live.update_log import log_path, read_log
from serving.protos import admin_pb2 as pb
from serving.protos.admin_pb2_grpc import AdminStub
from serving.repository.repository import ModelRepository
from serving.sharding import routed_updates
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

    def start_router(self) -> Server:
        cfg = RouterConfig(shards=[[a] for a in self.addresses], shard_deadline_ms=10_000.0)
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
    finish = routed_updates.RoutedUpdates._finish

    def crash_before_commit(self, version, seq, addresses, commit):
        if commit:
            raise RuntimeError("router killed after its log, before the shards' commit")
        finish(self, version, seq, addresses, commit)

    monkeypatch.setattr(routed_updates.RoutedUpdates, "_finish", crash_before_commit)
    routed.router.updates._stop.set()  # type: ignore[union-attr]  # no sync loop: it is "dead"
    with pytest.raises(grpc.RpcError):
        routed.admin.RemoveItems(pb.RemoveItemsRequest(ids=[3, 4]), timeout=WAIT)
    assert len(read_log(log_path(routed.state, "demo", routed.version)).records) == 1
    assert routed.sequences() == [0, 0]  # prepared, never committed
    monkeypatch.setattr(routed_updates.RoutedUpdates, "_finish", finish)
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

        def counted(model, version, sequence, record, prepare=prepare):
            prepares.append(sequence)
            return prepare(model, version, sequence, record)

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
