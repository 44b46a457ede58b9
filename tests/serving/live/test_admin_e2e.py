"""``recserve serve`` with a state folder as a real process: add an item and flip its attribute
over the admin API, see both in the next Recommend, ``kill -9`` the server (and tear the log's
tail as a crash mid-write would), start it again: the updates are replayed from the log."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from common.process import Proc
from serving.live.update_log import HEADER, MAGIC, log_path
from serving.protos import admin_pb2 as pb
from serving.protos.admin_pb2_grpc import AdminStub
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository import repository
from support.process_util import STARTUP_S, serve_cmd
from support.process_util import start_server as start_process

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

WAIT = 10.0
NEW_ID = 7777


def start_server(tmp_path: Path, toml: Path, run: int) -> tuple[Proc, str, Path]:
    cmd = serve_cmd("--model-repo", tmp_path / "repo", "--grpc-port", "0", "--config", toml)
    proc = start_process(cmd, tmp_path, f"serve{run}")
    try:
        ready = proc.wait_ready(STARTUP_S)
    except BaseException:
        proc.stop()
        raise
    assert (ready.model, ready.version, ready.http, ready.metrics) == ("demo", 1, None, None)
    assert ready.grpc is not None
    return proc, ready.grpc, proc.log_path


def test_updates_survive_kill_9(tmp_path: Path, tiny):
    repository.ModelRepository(tmp_path / "repo").publish("demo", tiny.model)
    state = tmp_path / "state"
    toml = tmp_path / "serve.toml"
    toml.write_text(f'state_dir = "{state}"\npoll_s = 0.0\n')
    with torch.inference_mode():
        q = tiny.model.user_vectors(tiny.prep.user_batch(np.array([0])))[0]
    item = pb.Item(
        id=NEW_ID,
        vector=(q * 50).tolist(),  # user 0's query direction, long: first for user 0
        attributes=[pb.Attribute(name="available", values=["false"])],
    )
    flip = pb.SetItemAttributesRequest(
        items=[
            pb.ItemAttributes(
                id=NEW_ID, attributes=[pb.Attribute(name="available", values=["true"])]
            )
        ]
    )
    available = tiny.message(0, filter="available")

    proc, address, _ = start_server(tmp_path, toml, 1)
    try:
        with grpc.insecure_channel(address) as channel:
            admin, rec = AdminStub(channel), RecommenderStub(channel)
            reply = admin.UpsertItems(pb.UpsertItemsRequest(items=[item]), timeout=WAIT)
            assert (reply.version, reply.sequence, reply.items) == (1, 1, 301)
            assert rec.Recommend(tiny.message(0), timeout=WAIT).item_ids[0] == NEW_ID
            assert NEW_ID not in rec.Recommend(available, timeout=WAIT).item_ids
            assert admin.SetItemAttributes(flip, timeout=WAIT).sequence == 2
            want = list(rec.Recommend(available, timeout=WAIT).item_ids)
            assert want[0] == NEW_ID
        proc.signal(signal.SIGKILL)  # no drain, no flush; acknowledged means fsync'd
        proc.wait(WAIT)
    finally:
        proc.stop()

    # a crash in the middle of a third append: half a frame at the end of the log
    path = log_path(state, "demo", 1)
    with open(path, "ab") as f:
        f.write(HEADER.pack(MAGIC, 500, 0)[: HEADER.size] + b"\x01" * 40)

    proc, address, err = start_server(tmp_path, toml, 2)
    try:
        with grpc.insecure_channel(address) as channel:
            admin, rec = AdminStub(channel), RecommenderStub(channel)
            assert list(rec.Recommend(available, timeout=WAIT).item_ids) == want
            reply = admin.RemoveItems(pb.RemoveItemsRequest(ids=[NEW_ID]), timeout=WAIT)
            assert reply.sequence == 3  # the torn record was dropped, not counted
            assert NEW_ID not in rec.Recommend(tiny.message(0), timeout=WAIT).item_ids
    finally:
        proc.stop()
    assert "dropping a torn last record" in err.read_text()
    assert "replayed 2 updates" in err.read_text()


def _rss_mib(pid: int) -> float:
    """The process's resident memory now (``VmRSS``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def test_huge_ids_are_refused_fast_without_growing_the_server(tmp_path: Path, tiny):
    """A ~30-byte ``AddSeen`` naming user 10**7 grew a server by ~90 MB (the store's index of
    users rebuilt to 10**7 rows) and 2**62 by more before failing: now both are refused naming
    ``users`` and the bound, before the store grows; an ``UpsertItems`` of item 2**62 (its
    vector given) and a seen pair naming it are refused naming the item's field and the item
    bound; nothing is logged for any of them, and a valid call still applies as update 1."""
    repository.ModelRepository(tmp_path / "repo").publish("demo", tiny.with_seen_store())
    toml = tmp_path / "serve.toml"
    toml.write_text(f'state_dir = "{tmp_path / "state"}"\npoll_s = 0.0\n')
    proc, address, _ = start_server(tmp_path, toml, 1)
    try:
        with grpc.insecure_channel(address) as channel:
            admin = AdminStub(channel)
            with pytest.raises(grpc.RpcError):  # connected and warm: the refusal path once
                admin.AddSeen(pb.AddSeenRequest(users=[1], items=[1 << 40]), timeout=WAIT)
            before, took = _rss_mib(proc.pid), []
            for user in (10**7, 1 << 62):
                start = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    admin.AddSeen(pb.AddSeenRequest(users=[user], items=[7]), timeout=WAIT)
                elapsed = time.monotonic() - start
                took.append(elapsed)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith(f"users[0]: user {user} is past the seen")
                assert "limits.max_seen_user_growth" in err.value.details()
                assert elapsed < 1.0, f"refused after {elapsed:.2f} s"
            huge = [
                (admin.UpsertItems, pb.UpsertItemsRequest(items=[pb.Item(id=1 << 62, vector=[0.5] * tiny.model.index.dim)]), "items[0].id"),
                (admin.AddSeen, pb.AddSeenRequest(users=[3], items=[1 << 62]), "items[0]"),
            ]  # fmt: skip
            for call, request_, where in huge:
                start = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    call(request_, timeout=WAIT)
                took.append(time.monotonic() - start)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith(
                    f"{where}: item {1 << 62} is past the catalog"
                )
                # an upsert takes the growth bound; a seen pair, the items the server holds
                named = "(limits.max_item_id_growth)" if call == admin.UpsertItems else "(item ids"
                assert named in err.value.details()
            grown = _rss_mib(proc.pid) - before
            assert grown < 16, f"the server grew by {grown:.1f} MiB on refused calls"
            reply = admin.AddSeen(pb.AddSeenRequest(users=[3], items=[7]), timeout=WAIT)
            assert reply.sequence == 1  # the refused calls logged nothing
            print(f"huge ids: refused in <= {max(took) * 1000:.1f} ms, grew {grown:.1f} MiB")
    finally:
        proc.stop()
