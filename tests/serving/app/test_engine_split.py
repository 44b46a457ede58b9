"""``recserve serve model --frontends 2`` as real processes (one engine, two front ends on one
port): every protocol answers as the single process does; live updates and hot reload reach
every front end at once; kill -9 of a front end and of the engine, and SIGTERM, under load."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc
import tritonclient.http
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.process import Proc
from loadtest.workload import OWN_CONNECTION
from serving.protos import admin_pb2
from serving.protos.admin_pb2_grpc import AdminStub
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository import repository
from support.process_util import STARTUP_S, serve_cmd, start_server
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

WAIT = 10.0
USERS = list(range(0, 100, 9))
READY = re.compile(r"process (engine|\d+) \(pid (\d+)\) ready")


def serve(tmp_path: Path, name: str, *extra: str | Path) -> Proc:
    cmd = serve_cmd("--model-repo", tmp_path / "repo", "--model", "demo", "--grpc-port", "0",
                    *extra)  # fmt: skip
    return start_server(cmd, tmp_path, name)


def pids(proc: Proc) -> dict[str, list[int]]:
    """Slot ("engine", "0", "1") -> the pid of each start, oldest first, from the parent's log."""
    out: dict[str, list[int]] = {}
    for slot, pid in READY.findall(proc.log_path.read_text()):
        out.setdefault(slot, []).append(int(pid))
    return out


def own(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[OWN_CONNECTION])


def recommend_each(address: str, tiny, **kw) -> dict[int, tuple]:
    """Every user's answer, each call on a connection of its own (spread over the front ends)."""
    out = {}
    for u in USERS:
        with own(address) as channel:
            r = RecommenderStub(channel).Recommend(tiny.message(u, **kw), timeout=WAIT)
            out[u] = (list(r.item_ids), list(r.scores), r.model, r.version)
    return out


def answered_each(address: str, tiny) -> dict[int, tuple] | None:
    """:func:`recommend_each`, or None when a call was refused."""
    try:
        return recommend_each(address, tiny)
    except grpc.RpcError:
        return None


def refusal(address: str, message) -> tuple:
    with own(address) as channel:
        try:
            RecommenderStub(channel).Recommend(message, timeout=WAIT)
        except grpc.RpcError as e:
            return e.code(), e.details()
    raise AssertionError("not refused")


def kserve_inputs(module, tiny, users: list[int], k: int) -> list:
    batch = tiny.prep.user_batch(np.array(users))
    tensors = (
        ("history", "INT64", batch.history.numpy().astype(np.int64)),
        ("categorical", "INT64", batch.categorical.numpy().astype(np.int64)),
        ("dense", "FP32", batch.dense.numpy().astype(np.float32)),
        ("k", "INT32", np.full((len(users), 1), k, dtype=np.int32)),
    )
    inputs = []
    for name, dtype, values in tensors:
        inputs.append(module.InferInput(name, list(values.shape), dtype))
        inputs[-1].set_data_from_numpy(values)
    return inputs


def kserve_answers(grpc_address: str, http_address: str, tiny) -> list:
    out = []
    for module, address in ((tritonclient.grpc, grpc_address), (tritonclient.http, http_address)):
        client = module.InferenceServerClient(address)
        out.append((client.is_server_ready(), client.is_model_ready("demo")))
        result = client.infer("demo", kserve_inputs(module, tiny, USERS[:3], 7))
        scores = result.as_numpy("scores").round(5).tolist()  # rows may batch differently
        out.append((result.as_numpy("item_ids").tolist(), scores))
        meta = client.get_model_metadata("demo")
        config = client.get_model_config("demo")
        if module is tritonclient.grpc:
            meta, config = json_format.MessageToDict(meta), json_format.MessageToDict(config)
        out += [meta, config]
        try:
            client.infer("demo", kserve_inputs(module, tiny, USERS[:2], 0))
        except Exception as e:  # InferenceServerException: k out of range, naming the row
            out.append(str(e))
        client.close()
    return out


def metric(address: str, name: str) -> dict[str, float]:
    """``name``'s value per ``process`` label, summed over its other labels."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=WAIT).read().decode()
    out: Counter[str] = Counter()
    for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        process = re.search(r'process="([^"]+)"', labels)
        out[process.group(1) if process else ""] += float(value)
    return dict(out)


def test_the_split_answers_every_protocol_as_one_process(tmp_path: Path, tiny):
    repository.ModelRepository(tmp_path / "repo").publish("demo", tiny.model)
    one = serve(tmp_path, "one", "--http-port", "0")
    split = serve(tmp_path, "split", "--http-port", "0", "--metrics-port", "0", "--frontends", "2")
    try:
        a, b = one.wait_ready(STARTUP_S), split.wait_ready(STARTUP_S)
        assert (b.role, b.model, b.version, b.processes) == ("serve", "demo", 1, 2)
        with torch.inference_mode():
            ids, _ = tiny.model(tiny.prep.user_batch(np.array(USERS)), 10)
        got = recommend_each(b.grpc, tiny)
        assert {u: r[0] for u, r in got.items()} == dict(zip(USERS, ids.tolist(), strict=True))
        assert got == recommend_each(a.grpc, tiny)
        assert recommend_each(b.grpc, tiny, filter="language = 'en'", seen=[1, 2]) == (
            recommend_each(a.grpc, tiny, filter="language = 'en'", seen=[1, 2])
        )
        for bad in (tiny.message(1, k=0), tiny.message(1, model="nope"),
                    tiny.message(1, filter="colour = 'red'"), tiny.message(1, version=9)):  # fmt: skip
            assert refusal(b.grpc, bad) == refusal(a.grpc, bad)
        assert kserve_answers(b.grpc, b.http, tiny) == kserve_answers(a.grpc, a.http, tiny)

        assert b.metrics is not None
        calls = metric(b.metrics, "nv_inference_request_success")
        assert set(calls) == {"0", "1"} and min(calls.values()) > 0  # both front ends answered
        assert metric(b.metrics, "recserve_batch_size_count")["engine"] > 0  # one engine batched
        assert metric(b.metrics, "recserve_model_version") == {"engine": 1.0}
    finally:
        one.stop()
        split.stop()


def test_live_updates_and_hot_reload_reach_both_front_ends_at_once(tmp_path: Path, tiny):
    repo = repository.ModelRepository(tmp_path / "repo")
    repo.publish("demo", tiny.model)
    toml = tmp_path / "serve.toml"
    toml.write_text("poll_s = 0.2\n")
    proc = serve(tmp_path, "split", "--frontends", "2", "--state-dir", tmp_path / "state",
                 "--config", toml)  # fmt: skip
    try:
        ready = proc.wait_ready(STARTUP_S)
        before = recommend_each(ready.grpc, tiny)
        gone = before[USERS[0]][0][0]  # user 0's top item
        with own(ready.grpc) as channel:
            reply = AdminStub(channel).RemoveItems(
                admin_pb2.RemoveItemsRequest(ids=[gone], update_id="rm-1"), timeout=WAIT
            )
        assert (reply.version, reply.sequence) == (1, 1)
        after = recommend_each(ready.grpc, tiny)  # every connection, both front ends: applied
        assert all(gone not in r[0] for r in after.values())
        assert after[USERS[0]][0][:3] == before[USERS[0]][0][1:4]
        with own(ready.grpc) as channel:  # a retry of the same update: its reply, no change
            again = AdminStub(channel).RemoveItems(
                admin_pb2.RemoveItemsRequest(ids=[gone], update_id="rm-1"), timeout=WAIT
            )
        assert again.sequence == 1

        v2 = tiny.build(7)
        repo.publish("demo", v2)
        wait_until(lambda: recommend_each(ready.grpc, tiny)[USERS[0]][3] == 2, WAIT * 3, "v2")
        with torch.inference_mode():
            ids, _ = v2(tiny.prep.user_batch(np.array(USERS)), 10)
        now = recommend_each(ready.grpc, tiny)
        assert {u: (r[0], r[3]) for u, r in now.items()} == {
            u: (want, 2) for u, want in zip(USERS, ids.tolist(), strict=True)
        }  # one swap: no front end answers from version 1 any more
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.tail()
    finally:
        proc.stop()


def not_serving(address: str) -> bool:
    with own(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=WAIT
        )
    return bool(status.status == health_pb2.HealthCheckResponse.NOT_SERVING)


class Load:
    """Threads calling Recommend, each on its own connection, recording every outcome."""

    def __init__(self, address: str, tiny, threads: int = 3):
        self.address, self.tiny = address, tiny
        self.outcomes: list[tuple[float, str, float]] = []  # (when, code, seconds)
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        channel = own(self.address)
        stub = RecommenderStub(channel)
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                stub.Recommend(self.tiny.message(USERS[i % len(USERS)]), timeout=5.0)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
                time.sleep(0.02)
            with self._lock:
                self.outcomes.append((start, code, time.monotonic() - start))
        channel.close()

    def since(self, t: float) -> Counter[str]:
        with self._lock:
            return Counter(code for when, code, _ in self.outcomes if when >= t)

    def wait_for(self, code: str, t: float, timeout: float = 60.0) -> None:
        wait_until(lambda: self.since(t)[code] > 0, timeout, f"a call answered {code}")

    def close(self) -> float:
        """Stops; the longest call (none may hang: each answers within its timeout)."""
        self.stop.set()
        for t in self.threads:
            t.join(30)
        return max(s for _, _, s in self.outcomes)


def test_crashes_and_sigterm_under_load(tmp_path: Path, tiny):
    repository.ModelRepository(tmp_path / "repo").publish("demo", tiny.model)
    proc = serve(tmp_path, "split", "--frontends", "2")
    load = None
    try:
        ready = proc.wait_ready(STARTUP_S)
        load = Load(ready.grpc, tiny)
        load.wait_for("OK", 0.0)
        first = pids(proc)

        # kill -9 a front end: the parent starts another, the engine is not touched
        os.kill(first["0"][-1], signal.SIGKILL)
        wait_until(lambda: len(pids(proc).get("0", [])) == 2, 90, "front end 0 restarted")
        assert pids(proc)["engine"] == first["engine"] and pids(proc)["1"] == first["1"]
        load.wait_for("OK", time.monotonic())

        # kill -9 the engine: every front end answers UNAVAILABLE, then the engine is back
        killed = time.monotonic()
        os.kill(first["engine"][-1], signal.SIGKILL)
        load.wait_for("UNAVAILABLE", killed, 10)
        refused_after = min(w + d for w, c, d in load.outcomes if w >= killed and c != "OK")
        assert not_serving(ready.grpc)  # health follows the engine: balancers look elsewhere
        wait_until(lambda: len(pids(proc).get("engine", [])) == 2, 90, "the engine restarted")
        back = time.monotonic()
        load.wait_for("OK", back)
        print(
            f"figures: engine killed -> first refusal {refused_after - killed:.2f} s; "
            f"during the outage {dict(load.since(killed) - load.since(back))}; "
            f"after the front end's kill -9 {dict(load.since(0.0) - load.since(killed))}"
        )
        assert len(pids(proc)["0"]) == 2 and pids(proc)["1"] == first["1"]  # front ends stayed
        # each front end hears of the new engine at its next ping: UNAVAILABLE until then
        got = wait_until(lambda: answered_each(ready.grpc, tiny), 10, "both front ends answer")
        with torch.inference_mode():
            ids, _ = tiny.model(tiny.prep.user_batch(np.array(USERS)), 10)
        assert {u: r[0] for u, r in got.items()} == dict(zip(USERS, ids.tolist(), strict=True))

        # SIGTERM under load: front ends drain, then the engine; status 0
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.tail()
        longest = load.close()
        print(f"figures: longest call {longest:.2f} s of {len(load.outcomes)}")
        assert longest < 6.0  # every call was answered or refused; none hung
        codes = Counter(code for _, code, _ in load.outcomes)
        assert set(codes) <= {"OK", "UNAVAILABLE", "CANCELLED"}, codes
        load = None
    finally:
        if load is not None:
            load.close()
        proc.stop()
