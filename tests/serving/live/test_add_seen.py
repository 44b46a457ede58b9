"""``AddSeen`` through the admin API, in-process (a real server on 127.0.0.1, the stand-in
repository): what a user consumed is never recommended to requests naming that user from the
next request on, survives a restart (the log is replayed), leaves other users alone, and is
refused naming the field by a model without a seen store or with a malformed batch."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from retrieval.model import RetrievalModel
from serving.app.server import Server
from serving.live import admin
from serving.live.update_log import UpdateLog, log_path
from serving.protos import admin_pb2 as pb
from serving.protos import recommend_pb2
from serving.protos.admin_pb2_grpc import AdminStub
from serving.protos.recommend_pb2_grpc import RecommenderStub
from support.tiny_model import Tiny, start_server

WAIT = 10.0


@pytest.fixture
def start(serve_config, tmp_path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def make(model: RetrievalModel, **overrides: Any) -> Server:
        config = serve_config(state_dir=tmp_path / "state", **overrides)
        servers.append(start_server(config, model, extra_servicers=[admin.add_servicer]))
        return servers[-1]

    yield make
    for s in servers:
        s.drain_and_stop(timeout=WAIT)


def _named(tiny: Tiny, user: int) -> recommend_pb2.RecommendRequest:
    msg = tiny.message(user)
    msg.user = user
    return msg


def _ids(stub: RecommenderStub, msg: recommend_pb2.RecommendRequest) -> list[int]:
    return list(stub.Recommend(msg, timeout=WAIT).item_ids)


def test_consumed_items_leave_the_users_answers_and_survive_a_restart(start, tiny):
    server = start(tiny.with_seen_store())
    channel = grpc.insecure_channel(server.addresses.grpc)
    adm, rec = AdminStub(channel), RecommenderStub(channel)
    before = {u: _ids(rec, _named(tiny, u)) for u in (3, 4)}
    consumed = before[3][:3]  # user 3 watched its top three
    reply = adm.AddSeen(pb.AddSeenRequest(users=[3, 3, 3], items=consumed), timeout=WAIT)
    assert (reply.version, reply.sequence) == (1, 1)
    after = _ids(rec, _named(tiny, 3))
    assert not set(after) & set(consumed) and after[:-3] == before[3][3:]  # the rest move up
    assert _ids(rec, _named(tiny, 4)) == before[4]  # another user: unchanged
    assert _ids(rec, tiny.message(3)) == before[3]  # not naming the user: the store is not read
    # a new user beyond the store grows it
    assert adm.AddSeen(pb.AddSeenRequest(users=[10_000], items=[1]), timeout=WAIT).sequence == 2
    channel.close()

    server.drain_and_stop(timeout=WAIT)
    again = start(tiny.with_seen_store())  # a fresh copy of version 1: the log is replayed
    with grpc.insecure_channel(again.addresses.grpc) as channel2:
        assert _ids(RecommenderStub(channel2), _named(tiny, 3)) == after


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            pb.AddSeenRequest(users=[1, 2], items=[5]),
            "items: expected one item per user (2), got 1",
        ),
        (pb.AddSeenRequest(users=[-1], items=[5]), "users[0]: must be >= 0, got -1"),
        (pb.AddSeenRequest(users=[], items=[]), "users: empty: nothing to update"),
        # the tiny model's catalog is items 0..299, its store holds users 0..99
        (
            pb.AddSeenRequest(users=[1, 2], items=[5, 300]),
            "items[1]: item 300 is past the catalog (item ids 0..299, the item table's and "
            "those upserted since)",
        ),
        (
            pb.AddSeenRequest(users=[1], items=[1 << 62]),
            f"items[0]: item {1 << 62} is past the catalog (item ids 0..299, the item table's "
            "and those upserted since)",
        ),
        (
            pb.AddSeenRequest(users=[3, 10**7], items=[7, 7]),
            "users[1]: user 10000000 is past the seen store's 100 users + 100000 "
            "(limits.max_seen_user_growth): ids up to 100099 are taken",
        ),
        (
            pb.AddSeenRequest(users=[1 << 62], items=[7]),
            f"users[0]: user {1 << 62} is past the seen store's 100 users + 100000 "
            "(limits.max_seen_user_growth): ids up to 100099 are taken",
        ),
    ],
)
def test_bad_batches_are_refused_naming_the_field(start, tiny, request_, message):
    server = start(tiny.with_seen_store())
    with grpc.insecure_channel(server.addresses.grpc) as ch, pytest.raises(grpc.RpcError) as err:
        AdminStub(ch).AddSeen(request_, timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == message


def test_the_user_bound_follows_the_configured_growth_and_the_store(start, tiny):
    """``limits.max_seen_user_growth`` 2: users 100 and 101 are taken (the store grows to 102),
    then 103 is (102 + 2 > 103) and 104 is not; a refused call logs nothing."""
    server = start(tiny.with_seen_store(), limits={"max_seen_user_growth": 2})
    with grpc.insecure_channel(server.addresses.grpc) as ch:
        adm = AdminStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            adm.AddSeen(pb.AddSeenRequest(users=[102], items=[1]), timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("users[0]: user 102 is past the seen store's 100")
        assert adm.AddSeen(pb.AddSeenRequest(users=[101], items=[1]), timeout=WAIT).sequence == 1
        with pytest.raises(grpc.RpcError) as err:
            adm.AddSeen(pb.AddSeenRequest(users=[104], items=[1]), timeout=WAIT)
        assert "ids up to 103 are taken" in err.value.details()
        assert adm.AddSeen(pb.AddSeenRequest(users=[103], items=[1]), timeout=WAIT).sequence == 2


def test_a_model_without_a_store_refuses_add_seen(start, tiny):
    server = start(copy.deepcopy(tiny.model))
    with grpc.insecure_channel(server.addresses.grpc) as ch, pytest.raises(grpc.RpcError) as err:
        AdminStub(ch).AddSeen(pb.AddSeenRequest(users=[1], items=[2]), timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("users: the model keeps no seen store")


def _query_item(tiny: Tiny, id_: int, user: int) -> pb.Item:
    """Item ``id_`` with a vector along ``user``'s query, long: it ranks first for that user."""
    with torch.inference_mode():
        q = tiny.model.user_vectors(tiny.prep.user_batch(np.array([user])))[0]
    return pb.Item(id=id_, vector=(q * 50).tolist())


def test_seen_pairs_name_the_items_the_server_holds(start, tiny):
    """``limits.max_item_id_growth`` 10 over the 300-item catalog: a seen pair naming item 309
    is refused until 309 is upserted (its vector given), then taken; 310 is refused by both, the
    upsert naming the growth bound, the seen pair the items held, and nothing is logged for it."""
    server = start(tiny.with_seen_store(), limits={"max_item_id_growth": 10})
    with grpc.insecure_channel(server.addresses.grpc) as ch:
        adm, rec = AdminStub(ch), RecommenderStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            adm.AddSeen(pb.AddSeenRequest(users=[3], items=[309]), timeout=WAIT)
        assert err.value.details() == (
            "items[0]: item 309 is past the catalog (item ids 0..299, the item table's and "
            "those upserted since)"
        )
        assert (
            adm.UpsertItems(
                pb.UpsertItemsRequest(items=[_query_item(tiny, 309, 3)]), timeout=WAIT
            ).sequence
            == 1
        )
        assert _ids(rec, _named(tiny, 3))[0] == 309
        assert adm.AddSeen(pb.AddSeenRequest(users=[3], items=[309]), timeout=WAIT).sequence == 2
        assert 309 not in _ids(rec, _named(tiny, 3))
        grown = "is past the catalog's 300 items + 10 (limits.max_item_id_growth): ids up to 309"
        held = "is past the catalog (item ids 0..309, the item table's and those upserted since)"
        calls = [
            (adm.UpsertItems, pb.UpsertItemsRequest(items=[_query_item(tiny, 310, 3)]), f"items[0].id: item 310 {grown} are taken"),
            (adm.AddSeen, pb.AddSeenRequest(users=[3, 3], items=[5, 310]), f"items[1]: item 310 {held}"),
        ]  # fmt: skip
        for call, request_, message in calls:
            with pytest.raises(grpc.RpcError) as err:
                call(request_, timeout=WAIT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == message
        assert adm.AddSeen(pb.AddSeenRequest(users=[4], items=[1]), timeout=WAIT).sequence == 3


def test_records_taken_under_looser_bounds_are_replayed(start, tiny, tmp_path):
    """A log written under looser bounds (or by older code, which had none) holds an upsert of
    item 2**62 and seen pairs past today's user and item bounds: the version still loads with
    every record applied; the bounds refuse only new calls."""
    huge, user = 1 << 62, 3
    path = log_path(tmp_path / "state", "demo", 1)
    records = [  # the seen pairs first: item 2**62 is not in the index yet
        pb.LogRecord(sequence=1, add_seen=pb.AddSeenRequest(users=[user, 150], items=[huge, 400])),
        pb.LogRecord(sequence=2, upsert_items=pb.UpsertItemsRequest(items=[_query_item(tiny, huge, user)])),
    ]  # fmt: skip
    update_log, _ = UpdateLog.open(path)
    for r in records:
        update_log.append(r.SerializeToString())
    update_log.close()

    limits = {"max_item_id_growth": 0, "max_seen_user_growth": 0}
    server = start(tiny.with_seen_store(), limits=limits)
    loaded = server.host.loaded
    assert loaded is not None and loaded.sequence == 2
    with grpc.insecure_channel(server.addresses.grpc) as ch:
        adm, rec = AdminStub(ch), RecommenderStub(ch)
        assert _ids(rec, tiny.message(user))[0] == huge  # the upsert was replayed
        assert huge not in _ids(rec, _named(tiny, user))  # and the seen pair
        for request_ in (
            pb.AddSeenRequest(users=[user], items=[huge + 1]),  # past the items it knows of
            pb.AddSeenRequest(users=[151], items=[1]),  # past the store, grown to 151 users
        ):
            with pytest.raises(grpc.RpcError) as err:
                adm.AddSeen(request_, timeout=WAIT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert adm.AddSeen(pb.AddSeenRequest(users=[150], items=[1]), timeout=WAIT).sequence == 3
