"""``recserve serve`` folding its fresh segment in the background, as a real process: updates
past ``compact_at`` start a compaction, which is held between its fold and its swap
(``RECSERVE_COMPACT_HOLD_S``) while an update is still acknowledged and answerable; ``kill -9``
there, start again: the log replays to the same answers, and a later compaction folds them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from common.process import Proc, start
from serving.live.compactor import HOLD_ENV
from serving.protos import admin_pb2 as pb
from serving.protos.admin_pb2_grpc import AdminStub
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository import repository
from support.process_util import STARTUP_S, serve_cmd

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

WAIT = 10.0
FIRST = 6000


def start_server(tmp_path: Path, toml: Path, run: int, hold_s: float = 0.0) -> tuple[Proc, str]:
    cmd = serve_cmd("--model-repo", tmp_path / "repo", "--grpc-port", "0", "--config", toml)
    env = {k: v for k, v in os.environ.items() if k != HOLD_ENV}
    if hold_s:
        env[HOLD_ENV] = str(hold_s)
    proc = start(cmd, env=env, log_path=tmp_path / f"serve{run}.log", name=f"serve{run}")
    try:
        ready = proc.wait_ready(STARTUP_S)
    except BaseException:
        proc.stop()
        raise
    assert ready.grpc is not None
    return proc, ready.grpc


def wait_for_line(path: Path, text: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not logged within {timeout} s:\n{path.read_text()[-2000:]}")


def answers(rec: RecommenderStub, tiny, users=range(6)) -> dict:
    out = {}
    for u in users:
        for f in ("", "available", "not available"):
            msg = tiny.message(u, filter=f) if f else tiny.message(u)
            out[(u, f)] = list(rec.Recommend(msg, timeout=WAIT).item_ids)
    return out


def test_a_kill_during_a_compaction_replays_to_the_same_answers(tmp_path: Path, tiny):
    repository.ModelRepository(tmp_path / "repo").publish("demo", tiny.model)
    toml = tmp_path / "serve.toml"
    toml.write_text(f'state_dir = "{tmp_path / "state"}"\npoll_s = 0.0\ncompact_at = 40\n')
    dim = tiny.model.index.dim
    g = torch.Generator().manual_seed(0)
    avail = [pb.Attribute(name="available", values=["true"])]
    new = [
        pb.Item(id=FIRST + i, vector=torch.randn(dim, generator=g).tolist(), attributes=avail)
        for i in range(30)
    ]
    off = [pb.Attribute(name="available", values=["false"])]
    flips = pb.SetItemAttributesRequest(
        items=[pb.ItemAttributes(id=i, attributes=off) for i in range(10, 15)]
    )
    with torch.inference_mode():
        q = tiny.model.user_vectors(tiny.prep.user_batch(np.array([0])))[0]
    late = pb.Item(id=FIRST + 100, vector=(q * 50).tolist(), attributes=avail)

    proc, address = start_server(tmp_path, toml, 1, hold_s=120.0)
    log1 = tmp_path / "serve1.log"
    try:
        with grpc.insecure_channel(address) as channel:
            admin, rec = AdminStub(channel), RecommenderStub(channel)
            assert admin.UpsertItems(pb.UpsertItemsRequest(items=new), timeout=WAIT).sequence == 1
            admin.RemoveItems(pb.RemoveItemsRequest(ids=list(range(5))), timeout=WAIT)
            assert admin.SetItemAttributes(flips, timeout=WAIT).sequence == 3  # 45 >= 40
            wait_for_line(log1, "compaction started")
            # held between its fold and its swap: an update is still taken and answerable
            reply = admin.UpsertItems(pb.UpsertItemsRequest(items=[late]), timeout=WAIT)
            assert (reply.sequence, reply.items) == (4, 300 + 30 - 5 + 1)
            assert rec.Recommend(tiny.message(0), timeout=WAIT).item_ids[0] == late.id
            want = answers(rec, tiny)
        assert "compaction done" not in log1.read_text()
        proc.signal(signal.SIGKILL)  # mid-compaction: the fold built, never swapped in
        proc.wait(WAIT)
    finally:
        proc.stop()

    proc, address = start_server(tmp_path, toml, 2)
    log2 = tmp_path / "serve2.log"
    try:
        with grpc.insecure_channel(address) as channel:
            admin, rec = AdminStub(channel), RecommenderStub(channel)
            assert answers(rec, tiny) == want  # every acknowledged update, as it was served
            again = pb.SetItemAttributesRequest(
                items=[pb.ItemAttributes(id=late.id, attributes=avail)]
            )
            reply = admin.SetItemAttributes(again, timeout=WAIT)  # a no-op relabel: compacts
            assert (reply.sequence, reply.items) == (5, 326)
            wait_for_line(log2, "compaction done")
            folded = answers(rec, tiny)
            assert folded[(0, "")][0] == late.id
            for got in folded.values():
                assert not set(got) & set(range(5))  # removed
            for u in range(6):
                assert not set(folded[(u, "available")]) & set(range(10, 15))  # flipped off
            same = sum(len(set(folded[k]) & set(want[k])) for k in want)
            assert same >= 0.9 * sum(len(v) for v in want.values())
    finally:
        proc.stop()
    assert "replayed 4 updates" in log2.read_text()
