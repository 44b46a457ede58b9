"""``recserve serve`` as a real process over the real model repository: Recommend round trip,
health, hot reload under concurrent load with zero failures, SIGTERM drain."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc
import tritonclient.http
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository import repository
from support.process_util import STARTUP_S, serve_cmd, start_server
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

WAIT = 10.0
USERS = list(range(0, 100, 7))


def expected(tiny, model, k: int = 10) -> dict[int, list[int]]:
    with torch.inference_mode():
        ids, _ = model(tiny.prep.user_batch(np.array(USERS)), k)
    return dict(zip(USERS, ids.tolist(), strict=True))


def kserve_inputs(module, tiny, user: int, k: int) -> list:
    """One user's request as KServe v2 tensors (the names and dtypes of serving/types.py)."""
    batch = tiny.prep.user_batch(np.array([user]))
    history = batch.history[0][batch.history[0] >= 0].numpy()[None, :]
    tensors = (
        ("history", "INT64", history.astype(np.int64)),
        ("categorical", "INT64", batch.categorical.numpy().astype(np.int64)),
        ("dense", "FP32", batch.dense.numpy().astype(np.float32)),
        ("k", "INT32", np.array([[k]], dtype=np.int32)),
    )
    inputs = []
    for name, dtype, values in tensors:
        inputs.append(module.InferInput(name, list(values.shape), dtype))
        inputs[-1].set_data_from_numpy(values)
    return inputs


def test_serve_round_trip_hot_reload_and_drain(tmp_path: Path, tiny):
    repo = repository.ModelRepository(tmp_path / "repo")
    v1 = repo.publish("demo", tiny.model)
    v2_model = tiny.build(7)
    toml = tmp_path / "serve.toml"
    toml.write_text(
        "poll_s = 0.2\ndrain_timeout_s = 10.0\nclose_linger_s = 1.0\n"
        "[batching]\nmax_queue_delay_ms = 2.0\n"
    )
    cmd = serve_cmd("--model-repo", tmp_path / "repo", "--model", "demo", "--grpc-port", "0",
                    "--http-port", "0", "--metrics-port", "0", "--config", toml)  # fmt: skip
    proc = start_server(cmd, tmp_path, "serve")
    err = proc.log_path
    try:
        ready = proc.wait_ready(STARTUP_S)
        assert (ready.role, ready.model, ready.version, ready.processes) == ("serve", "demo", v1, 1)
        assert ready.metrics is not None
        address, http_address = ready.grpc, ready.http
        assert address and http_address
        channel = grpc.insecure_channel(address)
        stub = RecommenderStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT)
        assert status.status == health_pb2.HealthCheckResponse.SERVING

        # round trip: the ids an in-process forward gives
        want_v1 = expected(tiny, tiny.model)
        for u in USERS:
            reply = stub.Recommend(tiny.message(u), timeout=WAIT)
            assert (reply.model, reply.version) == ("demo", v1)
            assert list(reply.item_ids) == want_v1[u]
        # the KServe v2 protocol on the same process: tritonclient over gRPC and HTTP, unchanged
        for client in (
            tritonclient.grpc.InferenceServerClient(address),
            tritonclient.http.InferenceServerClient(http_address),
        ):
            module = tritonclient.grpc if "grpc" in type(client).__module__ else tritonclient.http
            assert client.is_server_ready() and client.is_model_ready("demo")
            u = USERS[0]
            inputs = kserve_inputs(module, tiny, u, k=10)
            ids = client.infer("demo", inputs).as_numpy("item_ids")[0].tolist()
            assert ids == want_v1[u][:10]
            client.close()

        # hot reload under concurrent load: zero failures, versions only move forward
        want_v2 = expected(tiny, v2_model)
        stop_load = threading.Event()
        failures: list[str] = []
        seen: list[list[int]] = [[] for _ in range(4)]

        def client(slot: int) -> None:
            i = slot
            while not stop_load.is_set():
                u = USERS[i % len(USERS)]
                i += 1
                try:
                    r = stub.Recommend(tiny.message(u), timeout=WAIT)
                except grpc.RpcError as e:
                    failures.append(f"{e.code()}: {e.details()}")
                    continue
                want = want_v1 if r.version == v1 else want_v2
                if list(r.item_ids) != want[u]:
                    failures.append(f"user {u}: wrong ids for version {r.version}")
                seen[slot].append(r.version)

        threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: all(seen), 60, "every client answered by v1")
        v2 = repo.publish("demo", v2_model)
        wait_until(lambda: all(v and v[-1] == v2 for v in seen), 60, "every client on v2")
        counts = [len(v) for v in seen]  # a few more answers each: none goes back to v1
        wait_until(
            lambda: all(len(v) >= n + 5 for v, n in zip(seen, counts, strict=True)),
            60,
            "answers after v2",
        )
        stop_load.set()
        for t in threads:
            t.join(WAIT)
        assert failures == []
        for versions in seen:
            assert versions[0] == v1 and versions[-1] == v2
            assert versions == sorted(versions)  # never back to the old version
        assert stub.Recommend(tiny.message(0), timeout=WAIT).version == v2

        # SIGTERM with requests in flight: health says NOT_SERVING, each request finishes or is
        # refused UNAVAILABLE, clean exit within the drain timeout
        outcomes: list[str] = []
        health_seen: list[str] = []
        details: list[str] = []
        stop_load.clear()

        def drain_client() -> None:
            while not stop_load.is_set():
                try:
                    stub.Recommend(tiny.message(1), timeout=WAIT)
                    outcomes.append("OK")
                except grpc.RpcError as e:
                    outcomes.append(e.code().name)
                    details.append(f"{e.code().name}: {e.details()}")
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        return

        drainers = [threading.Thread(target=drain_client) for _ in range(3)]
        for t in drainers:
            t.start()
        wait_until(lambda: len(outcomes) >= 3, 60, "requests in flight before SIGTERM")
        start = time.monotonic()
        proc.signal(signal.SIGTERM)
        while proc.alive() and time.monotonic() - start < 5.0:  # the linger window
            try:
                check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                health_seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(check.status))
            except grpc.RpcError as e:
                health_seen.append(e.code().name)
            time.sleep(0.05)
        assert "NOT_SERVING" in health_seen, health_seen  # load balancers stop sending
        assert proc.wait(15) == 0, err.read_text()
        assert time.monotonic() - start < 10.0
        stop_load.set()
        for t in drainers:
            t.join(WAIT)
        channel.close()
        assert "OK" in outcomes and set(outcomes) <= {"OK", "UNAVAILABLE"}, details
        assert "drained" in err.read_text()
    finally:
        proc.stop()
        if os.environ.get("SERVE_E2E_LOG"):
            print(err.read_text())
