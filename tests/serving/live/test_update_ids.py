"""Updates named by the client (``update_id``) on an unsharded server (a real gRPC server on
127.0.0.1): a retry of a logged update gets its reply and changes nothing, after a restart too;
an update whose caller gave up before it was logged is never applied."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from serving.app.server import Server
from serving.live import admin
from serving.live.update_log import log_path, read_log
from serving.live.updates import MAX_UPDATE_ID
from serving.protos import admin_pb2 as pb
from serving.protos.admin_pb2_grpc import AdminStub
from support.tiny_model import StandInRepo
from support.waiting import wait_until

WAIT = 10.0


@pytest.fixture
def start(serve_config, tmp_path) -> Iterator[Callable[[], Server]]:
    """``start()``: a server of a fresh copy of ``tiny`` with the admin service and a state
    folder (the same one each time: a second start replays the first's log)."""
    servers: list[Server] = []

    def make(model) -> Server:
        repo = StandInRepo()
        repo.publish(copy.deepcopy(model))
        config = serve_config(state_dir=tmp_path / "state")
        s = Server(config, repo=repo, extra_servicers=[admin.add_servicer])
        s.start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.drain_and_stop(timeout=WAIT)


def admin_stub(server: Server) -> AdminStub:
    assert server.addresses is not None
    return AdminStub(grpc.insecure_channel(server.addresses.grpc))


def records(tmp_path) -> int:
    return len(read_log(log_path(tmp_path / "state", "demo", 1)).records)


def test_a_retried_update_id_gets_the_logged_reply_and_applies_once(start, tiny, tmp_path):
    server = start(tiny.model)
    stub = admin_stub(server)
    first = stub.RemoveItems(pb.RemoveItemsRequest(ids=[3, 4], update_id="rm-1"), timeout=WAIT)
    assert (first.sequence, first.items, first.update_id) == (1, 298, "rm-1")
    again = stub.RemoveItems(pb.RemoveItemsRequest(ids=[3, 4], update_id="rm-1"), timeout=WAIT)
    assert again == first  # items 3 and 4 are gone: applied anew, it would be refused
    assert records(tmp_path) == 1
    other = stub.RemoveItems(pb.RemoveItemsRequest(ids=[5], update_id="rm-2"), timeout=WAIT)
    assert (other.sequence, other.items) == (2, 297)
    unnamed = stub.RemoveItems(pb.RemoveItemsRequest(ids=[6]), timeout=WAIT)
    assert (unnamed.sequence, unnamed.update_id) == (3, "")

    server.drain_and_stop(timeout=WAIT)  # the replay rebuilds the replies of named updates
    stub = admin_stub(start(tiny.model))
    assert stub.RemoveItems(pb.RemoveItemsRequest(update_id="rm-1"), timeout=WAIT) == first
    assert stub.RemoveItems(pb.RemoveItemsRequest(update_id="rm-2"), timeout=WAIT) == other
    assert records(tmp_path) == 3


def test_an_update_id_too_long_is_refused_naming_the_field(start, tiny, tmp_path):
    stub = admin_stub(start(tiny.model))
    with pytest.raises(grpc.RpcError) as err:
        stub.RemoveItems(
            pb.RemoveItemsRequest(ids=[3], update_id="x" * (MAX_UPDATE_ID + 1)), timeout=WAIT
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"update_id: at most {MAX_UPDATE_ID} characters, got 129"
    assert records(tmp_path) == 0


def test_an_update_whose_caller_gave_up_is_not_applied(start, tiny, tmp_path):
    """The call queues behind another update past its deadline: it is refused when its turn
    comes, and a retry with its update_id applies it (once)."""
    server = start(tiny.model)
    stub = admin_stub(server)
    release = threading.Event()
    holding = threading.Event()

    def hold_updates() -> None:
        with server.host.updating():
            holding.set()
            release.wait(WAIT)

    holder = threading.Thread(target=hold_updates)
    holder.start()
    try:
        assert holding.wait(WAIT)
        with pytest.raises(grpc.RpcError) as err:
            stub.RemoveItems(pb.RemoveItemsRequest(ids=[3], update_id="late"), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()
        holder.join(WAIT)

    def refused() -> bool:
        labels = {"model": "demo", "kind": "remove_items", "reason": "deadline_exceeded"}
        return bool(
            server.metrics.registry.get_sample_value("recserve_update_failures_total", labels)
        )

    wait_until(refused, timeout_s=WAIT, what="the queued update refused on its turn")
    assert records(tmp_path) == 0
    reply = stub.RemoveItems(pb.RemoveItemsRequest(ids=[3], update_id="late"), timeout=WAIT)
    assert (reply.sequence, reply.items) == (1, 299)
