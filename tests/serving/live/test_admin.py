"""The admin gRPC API in-process (a real server on 127.0.0.1, the stand-in repository): live
updates visible to the next Recommend, all-or-nothing refusals naming the wire field, the log
replayed by a restarted server, applied between batches, metrics, versions."""

from __future__ import annotations

import copy
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import torch

from retrieval.index import live_index
from retrieval.live_updates import UpdateEmbeddings, apply_update
from retrieval.model import RetrievalModel
from serving.app.server import Server
from serving.engine.host import NoLoadableVersionError
from serving.live import admin
from serving.live.update_log import UpdateLog, log_path, read_log
from serving.protos import admin_pb2 as pb
from serving.protos.admin_pb2_grpc import AdminStub
from serving.protos.recommend_pb2_grpc import RecommenderStub
from support.tiny_model import StandInRepo
from support.waiting import wait_until

WAIT = 10.0
NEW_ID = 5000


@pytest.fixture
def pristine(tiny) -> RetrievalModel:
    """A private copy of the tiny model (embedding updates write table rows in place)."""
    return copy.deepcopy(tiny.model)


@pytest.fixture
def start(serve_config, tmp_path) -> Iterator[Callable[..., Server]]:
    """``start(repo, **config)``: a started server with the admin service; stopped at the end."""
    servers: list[Server] = []

    def make(repo: StandInRepo, **overrides) -> Server:
        overrides.setdefault("state_dir", tmp_path / "state")
        s = Server(serve_config(**overrides), repo=repo, extra_servicers=[admin.add_servicer])
        s.start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.drain_and_stop(timeout=WAIT)


def stubs(server: Server) -> tuple[AdminStub, RecommenderStub]:
    channel = grpc.insecure_channel(server.addresses.grpc)
    return AdminStub(channel), RecommenderStub(channel)


def repo_of(model: RetrievalModel) -> StandInRepo:
    r = StandInRepo()
    r.publish(model)
    return r


def query_vector(tiny, user: int) -> list[float]:
    with torch.inference_mode():
        q = tiny.model.user_vectors(tiny.prep.user_batch(np.array([user])))[0]
    return (q * 50).tolist()  # aligned with the user's query and long: it ranks first


def attrs(**values: str) -> list[pb.Attribute]:
    return [pb.Attribute(name=k, values=[v]) for k, v in values.items()]


def upsert_new(stub: AdminStub, tiny, user: int = 0, **kw) -> pb.UpdateReply:
    item = pb.Item(id=NEW_ID, vector=query_vector(tiny, user), attributes=attrs(available="true"))
    return stub.UpsertItems(pb.UpsertItemsRequest(items=[item], **kw), timeout=WAIT)


def sample(server: Server, name: str, **labels: str) -> float | None:
    return server.metrics.registry.get_sample_value(name, {"model": "demo", **labels})


def test_updates_are_visible_to_the_next_request_and_replayed_after_a_restart(
    start, tiny, pristine, tmp_path
):
    server = start(repo_of(pristine))
    stub, rec = stubs(server)
    reply = upsert_new(stub, tiny)
    assert (reply.model, reply.version, reply.sequence, reply.items) == ("demo", 1, 1, 301)
    assert rec.Recommend(tiny.message(0), timeout=WAIT).item_ids[0] == NEW_ID
    # flip the new item's eligibility: a filter on it now keeps it out
    flip = pb.SetItemAttributesRequest(
        items=[pb.ItemAttributes(id=NEW_ID, attributes=attrs(available="false"))]
    )
    assert stub.SetItemAttributes(flip, timeout=WAIT).sequence == 2
    assert NEW_ID not in rec.Recommend(tiny.message(0, filter="available"), timeout=WAIT).item_ids
    assert (
        rec.Recommend(tiny.message(0, filter="not available"), timeout=WAIT).item_ids[0] == NEW_ID
    )
    # remove an item that user 1 would get first
    first = rec.Recommend(tiny.message(1), timeout=WAIT).item_ids[0]
    assert stub.RemoveItems(pb.RemoveItemsRequest(ids=[first]), timeout=WAIT).sequence == 3
    after = {u: list(rec.Recommend(tiny.message(u), timeout=WAIT).item_ids) for u in range(5)}
    assert first not in after[1]
    path = log_path(tmp_path / "state", "demo", 1)
    assert len(read_log(path).records) == 3

    # a restarted server (a fresh copy of version 1) replays the log before it serves
    server.drain_and_stop(timeout=WAIT)
    again = start(repo_of(copy.deepcopy(tiny.model)))
    _, rec2 = stubs(again)
    assert {
        u: list(rec2.Recommend(tiny.message(u), timeout=WAIT).item_ids) for u in range(5)
    } == after
    assert NEW_ID not in rec2.Recommend(tiny.message(0, filter="available"), timeout=WAIT).item_ids
    assert sample(again, "recserve_updates_replayed_total") == 3
    assert sample(again, "recserve_update_sequence") == 3
    stub2, _ = stubs(again)
    assert upsert_new(stub2, tiny, user=2).sequence == 4  # the sequence goes on


@pytest.mark.parametrize(
    ("kind", "call", "message"),
    [
        (
            "remove_items",
            lambda s: s.RemoveItems(pb.RemoveItemsRequest(ids=[3, 4242])),
            r"ids\[1\]: item 4242 is not in the index",
        ),
        (
            "upsert_items",
            lambda s: s.UpsertItems(
                pb.UpsertItemsRequest(
                    items=[pb.Item(id=NEW_ID, vector=[0.5] * 64), pb.Item(id=7, vector=[1.0] * 3)]
                )
            ),
            r"items\[1\]\.vector: expected 64 floats",
        ),
        (
            "upsert_items",
            lambda s: s.UpsertItems(
                pb.UpsertItemsRequest(
                    items=[
                        pb.Item(id=NEW_ID, vector=[0.5] * 64),
                        pb.Item(id=8, attributes=attrs(language="xx")),
                    ]
                )
            ),
            r"items\[1\]\.attributes\.language: unknown value 'xx'",
        ),
        (
            "upsert_items",
            lambda s: s.UpsertItems(pb.UpsertItemsRequest(items=[pb.Item(id=9999)])),
            r"items\[0\]\.vector: item 9999 is beyond the item table",
        ),
        (
            "set_item_attributes",
            lambda s: s.SetItemAttributes(
                pb.SetItemAttributesRequest(
                    items=[pb.ItemAttributes(id=1, attributes=attrs(colour="red"))]
                )
            ),
            r"items\[0\]\.attributes: unknown attribute 'colour'",
        ),
        (
            "update_embeddings",
            lambda s: s.UpdateEmbeddings(
                pb.UpdateEmbeddingsRequest(table="nope", rows=[1], values=[0.0] * 32)
            ),
            r"table: unknown table 'nope' \(known: item, ",
        ),
        (
            "update_embeddings",
            lambda s: s.UpdateEmbeddings(
                pb.UpdateEmbeddingsRequest(table="item", rows=[1, 2], values=[0.0] * 32)
            ),
            r"values: expected 2 rows x 32",
        ),
        (
            "update_embeddings",
            lambda s: s.UpdateEmbeddings(
                pb.UpdateEmbeddingsRequest(table="item", rows=[300], values=[0.0] * 32)
            ),
            r"rows\[0\]: 300 is not in \[0, 300\)",
        ),
        (
            "update_embeddings",
            lambda s: s.UpdateEmbeddings(
                pb.UpdateEmbeddingsRequest(
                    table="item", rows=[1, 2], values=[0.0] * 32 + [float("nan")] * 32
                )
            ),
            r"values \(row 1\): contains NaN or infinity",
        ),
        (
            "upsert_items",
            lambda s: s.UpsertItems(pb.UpsertItemsRequest()),
            "items: empty: nothing to update",
        ),
    ],
)
def test_a_bad_batch_is_refused_whole_naming_the_field(
    start, tiny, pristine, tmp_path, kind, call, message
):
    server = start(repo_of(pristine))
    stub, rec = stubs(server)
    before = list(rec.Recommend(tiny.message(0), timeout=WAIT).item_ids)
    with pytest.raises(grpc.RpcError) as err:
        call(stub)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.match(message, err.value.details()), err.value.details()
    assert list(rec.Recommend(tiny.message(0), timeout=WAIT).item_ids) == before
    assert live_index.served(server.host.current().model.index) == 300
    assert read_log(log_path(tmp_path / "state", "demo", 1)).records == []
    assert (
        sample(server, "recserve_update_failures_total", kind=kind, reason="invalid_argument") == 1
    )
    assert upsert_new(stub, tiny).sequence == 1  # nothing was logged


def test_embedding_rows_update_like_the_model_level_call(start, tiny, pristine):
    server = start(repo_of(pristine))
    stub, rec = stubs(server)
    region = int(tiny.request(0).categorical[0])
    values = torch.randn(1, 32)
    reply = stub.UpdateEmbeddings(
        pb.UpdateEmbeddingsRequest(
            table="user_region", rows=[region], values=values.flatten().tolist()
        ),
        timeout=WAIT,
    )
    assert reply.sequence == 1 and reply.items == 300
    want = apply_update(
        copy.deepcopy(tiny.model), UpdateEmbeddings("user_region", torch.tensor([region]), values)
    )
    ids, scores = tiny.expected(want, np.array([0]), 10)
    got = rec.Recommend(tiny.message(0), timeout=WAIT)
    assert list(got.item_ids) == ids[0].tolist()
    np.testing.assert_allclose(got.scores, scores[0], rtol=1e-5)
    _, old_scores = tiny.expected(tiny.model, np.array([0]), 10)
    assert not np.allclose(got.scores, old_scores[0])  # the row mattered


def test_an_update_waits_for_the_running_batch(start, tiny, pristine):
    server = start(repo_of(pristine))
    stub, _ = stubs(server)
    done = threading.Event()
    with server.host.gate.shared():  # a batch is running
        t = threading.Thread(target=lambda: (upsert_new(stub, tiny), done.set()))
        t.start()
        time.sleep(0.5)
        assert not done.is_set()  # logged perhaps, but not applied inside the batch
        assert live_index.served(server.host.current().model.index) == 300
    t.join(WAIT)
    assert done.is_set() and live_index.served(server.host.current().model.index) == 301


def test_updates_past_the_pending_bound_are_refused_at_once(start, tiny, pristine):
    server = start(repo_of(pristine), limits={"max_pending_updates": 2})
    stub, _ = stubs(server)
    replies: list[pb.UpdateReply] = []
    with server.host.gate.shared():  # a batch is running: the first update waits for it
        held = [
            threading.Thread(target=lambda u=u: replies.append(upsert_new(stub, tiny, user=u)))
            for u in range(2)
        ]
        for t in held:
            t.start()
        pending = server.state.pending_updates
        wait_until(lambda: pending.count == 2, WAIT, "two updates waiting")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            upsert_new(stub, tiny, user=3)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_pending_updates = 2" in err.value.details()
        assert time.monotonic() - started < WAIT / 2  # refused, not queued behind the batch
    for t in held:
        t.join(WAIT)
    assert sorted(r.sequence for r in replies) == [1, 2] and pending.count == 0
    assert sample(server, "recserve_update_failures_total", kind="upsert_items",
                  reason="queue_full") == 1  # fmt: skip
    upsert_new(stub, tiny)  # room again


def test_concurrent_requests_see_the_update_between_batches(start, tiny, pristine):
    server = start(repo_of(pristine))
    stub, rec = stubs(server)
    before = list(rec.Recommend(tiny.message(0), timeout=WAIT).item_ids)
    stop, failures, seen = threading.Event(), [], []

    def client() -> None:
        while not stop.is_set():
            try:
                ids = list(rec.Recommend(tiny.message(0), timeout=WAIT).item_ids)
            except grpc.RpcError as e:
                failures.append(e.details())
                continue
            seen.append(ids)

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: len(seen) >= 3, 30, "answers before the update")
    upsert_new(stub, tiny)
    wait_until(lambda: seen[-1][0] == NEW_ID, 30, "an answer with the new item")
    stop.set()
    for t in threads:
        t.join(WAIT)
    assert failures == []
    after = list(rec.Recommend(tiny.message(0), timeout=WAIT).item_ids)
    assert after[0] == NEW_ID
    assert seen and all(ids in (before, after) for ids in seen)  # never a half-applied index


def test_a_newer_version_starts_with_no_log_and_retired_logs_are_deleted(
    start, tiny, pristine, tmp_path
):
    repo = repo_of(pristine)
    server = start(repo)
    stub, rec = stubs(server)
    upsert_new(stub, tiny)
    repo.publish(copy.deepcopy(tiny.model))
    assert server.host.poll_once() == 2
    assert NEW_ID not in rec.Recommend(tiny.message(0), timeout=WAIT).item_ids  # superseded
    reply = upsert_new(stub, tiny, user=1)
    assert (reply.version, reply.sequence) == (2, 1)
    with pytest.raises(grpc.RpcError) as err:
        upsert_new(stub, tiny, version=1)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    v1_log = log_path(tmp_path / "state", "demo", 1)
    assert v1_log.exists()  # version 1 is still in the repository
    with repo._lock:
        del repo.models[1]
    repo.publish(copy.deepcopy(tiny.model))
    assert server.host.poll_once() == 3
    assert not v1_log.parent.exists() and log_path(tmp_path / "state", "demo", 2).exists()


def test_unbalanced_lists_recommend_a_rebuild(start, tiny, pristine, caplog):
    server = start(repo_of(pristine))
    stub, _ = stubs(server)
    index = server.host.current().model.index
    assert sample(server, "recserve_index_rebuild_recommended") == 0
    assert 1.0 <= sample(server, "recserve_index_list_imbalance") < 4.0
    centre = index.centroids[0]  # the default nlist of a 300-item catalog is small (N / 39)
    items = [
        pb.Item(id=1000 + i, vector=(centre + 0.001 * torch.randn(64)).tolist()) for i in range(900)
    ]
    with caplog.at_level(logging.WARNING, logger="serving.live.admin"):
        reply = stub.UpsertItems(pb.UpsertItemsRequest(items=items), timeout=WAIT)
    assert reply.rebuild_recommended and reply.list_imbalance > 4.0
    assert sample(server, "recserve_index_rebuild_recommended") == 1
    assert sample(server, "recserve_index_list_imbalance") == pytest.approx(reply.list_imbalance)
    assert "rebuild the index" in caplog.text
    assert sample(server, "recserve_updates_applied_total", kind="upsert_items") == 1


def test_admin_is_off_without_a_state_folder(start, tiny, pristine):
    server = start(repo_of(pristine), state_dir=None)
    stub, _ = stubs(server)
    with pytest.raises(grpc.RpcError) as err:
        upsert_new(stub, tiny)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "state_dir" in err.value.details()


def test_the_authorizer_hook_can_refuse(serve_config, tiny, pristine, tmp_path):
    def deny(context, method):
        raise PermissionError(f"admin {method}: no token")

    server = Server(
        serve_config(state_dir=tmp_path / "state"),
        repo=repo_of(pristine),
        extra_servicers=[lambda s, st: admin.add_servicer(s, st, authorize=deny)],
    )
    server.start()
    try:
        stub, _ = stubs(server)
        with pytest.raises(grpc.RpcError) as err:
            upsert_new(stub, tiny)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details() == "admin upsert_items: no token"
    finally:
        server.drain_and_stop(timeout=WAIT)


def test_a_log_that_does_not_apply_refuses_the_version(serve_config, tiny, pristine, tmp_path):
    state = tmp_path / "state"
    log, _ = UpdateLog.open(log_path(state, "demo", 1))
    bad = pb.LogRecord(sequence=1, remove_items=pb.RemoveItemsRequest(ids=[4242]))
    log.append(bad.SerializeToString())
    log.close()

    server = Server(serve_config(state_dir=state), repo=repo_of(pristine), extra_servicers=[])
    with pytest.raises(NoLoadableVersionError):
        server.start()
