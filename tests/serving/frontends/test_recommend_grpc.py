"""The gRPC front end in-process (a real server on 127.0.0.1, the stand-in repository):
status codes, health, draining, metrics, the optional HTTP app."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from serving.app.config import BatchingConfig
from serving.app.server import Server
from serving.frontends.recommend_grpc import SERVICE
from serving.protos.recommend_pb2_grpc import RecommenderStub

WAIT = 10.0


@pytest.fixture
def server(serve_config, repo) -> Iterator[Server]:
    batching = BatchingConfig(max_batch_size=8, max_queue_delay_ms=1.0, max_queue_size=2)
    s = Server(serve_config(batching=batching), repo=repo, extra_servicers=[])
    s.start()
    yield s
    s.state.batcher.gate.set()
    s.drain_and_stop(timeout=WAIT)


@pytest.fixture
def stub(server: Server) -> Iterator[RecommenderStub]:
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        yield RecommenderStub(channel)


def test_recommend_round_trip_equals_a_forward(server, stub, tiny):
    reply = stub.Recommend(tiny.message(3, k=12), timeout=WAIT)
    assert (reply.model, reply.version, reply.partial) == ("demo", 1, False)
    with torch.inference_mode():
        ids, scores = tiny.model(tiny.prep.user_batch(np.array([3])), 12)
    assert list(reply.item_ids) == ids[0].tolist()
    np.testing.assert_allclose(reply.scores, scores[0].numpy(), rtol=1e-6)
    assert server.announce_line().startswith(f"serving demo v1 grpc={server.addresses.grpc} ")


@pytest.mark.parametrize(
    ("kw", "code", "field"),
    [
        ({"k": 0}, grpc.StatusCode.INVALID_ARGUMENT, "k"),
        ({"k": 100_000}, grpc.StatusCode.INVALID_ARGUMENT, "k"),
        ({"filter": "language in {en"}, grpc.StatusCode.INVALID_ARGUMENT, "filter"),
        ({"categorical": [1]}, grpc.StatusCode.INVALID_ARGUMENT, "categorical"),
        ({"dense": [0.0]}, grpc.StatusCode.INVALID_ARGUMENT, "dense"),
        ({"history": [10**6]}, grpc.StatusCode.INVALID_ARGUMENT, "history"),
        ({"version": -1}, grpc.StatusCode.INVALID_ARGUMENT, "version"),
        ({"model": "other"}, grpc.StatusCode.NOT_FOUND, "model"),
        ({"version": 9}, grpc.StatusCode.NOT_FOUND, "version"),
    ],
)
def test_bad_requests_get_their_code_and_field_fast(server, stub, tiny, kw, code, field):
    msg = tiny.message(0)
    for name, value in kw.items():
        if isinstance(value, list):
            getattr(msg, name)[:] = value
        else:
            setattr(msg, name, value)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        stub.Recommend(msg, timeout=WAIT)
    assert time.monotonic() - start < 1.0
    assert err.value.code() == code
    assert err.value.details().startswith(field), err.value.details()
    assert stub.Recommend(tiny.message(0), timeout=WAIT).version == 1  # still up


def test_queue_full_is_resource_exhausted_and_deadline_is_deadline_exceeded(server, stub, tiny):
    batcher = server.state.batcher
    batcher.gate.clear()
    held = [stub.Recommend.future(tiny.message(u), timeout=WAIT) for u in (1, 2)]
    until = time.monotonic() + WAIT
    while batcher.waiting < 2 and time.monotonic() < until:
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as err:
        stub.Recommend(tiny.message(3), timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue full" in err.value.details()
    batcher.gate.set()
    assert [f.result().version for f in held] == [1, 1]

    batcher.gate.clear()
    with pytest.raises(grpc.RpcError) as err:
        stub.Recommend(tiny.message(4), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    batcher.gate.set()
    text = scrape(server)
    assert 'nv_inference_request_failure{model="demo",reason="REJECTED",version="1"} 2.0' in text
    assert 'recserve_request_failures_total{model="demo",reason="queue_full"} 1.0' in text
    assert 'recserve_request_failures_total{model="demo",reason="deadline_exceeded"} 1.0' in text


def test_an_oversized_message_is_refused_and_the_server_stays_up(server, stub, tiny):
    msg = tiny.message(0)
    msg.dense[:] = [0.5] * 1_200_000  # 4.8 MB > 4 MiB
    with pytest.raises(grpc.RpcError) as err:
        stub.Recommend(msg, timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Recommend(tiny.message(0), timeout=WAIT).version == 1


def test_health_and_draining(server, stub, tiny):
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        server.state.draining.set()
        server.grpc.drain()
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Recommend(tiny.message(0), timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def scrape(server: Server) -> str:
    url = f"http://{server.addresses.metrics}/metrics"
    with urllib.request.urlopen(url, timeout=WAIT) as r:
        return r.read().decode()


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page -> ``{(sample name, sorted labels): value}``."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_requests_batches_and_the_version(server, stub, tiny):
    for u in range(5):
        stub.Recommend(tiny.message(u), timeout=WAIT)
    answered = samples_of(scrape(server))
    with pytest.raises(grpc.RpcError):
        stub.Recommend(tiny.message(0, k=0), timeout=WAIT)
    text = scrape(server)
    assert 'nv_inference_request_success{model="demo",version="1"} 5.0' in text
    assert 'nv_inference_request_failure{model="demo",reason="OTHER",version="1"} 1.0' in text
    assert 'recserve_request_failures_total{model="demo",reason="invalid_argument"} 1.0' in text
    assert 'recserve_model_version{model="demo"} 1.0' in text
    v1, m = (("model", "demo"), ("version", "1")), (("model", "demo"),)
    assert answered["nv_inference_count", v1] == 5.0  # rows answered
    assert 1.0 <= answered["nv_inference_exec_count", v1] <= 5.0  # forwards ran
    assert answered["recserve_batch_size_count", m] == answered["nv_inference_exec_count", v1]
    for name in (
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_infer_duration_us",
    ):
        assert answered[name, v1] > 0.0, name
    assert answered["recserve_request_duration_seconds_count", m] == 5.0
    assert samples_of(text)["recserve_request_duration_seconds_count", m] == 6.0  # the refusal


def test_http_port_serves_the_http_app_it_is_given(serve_config, repo):
    async def app(scope, receive, send):  # the smallest ASGI app
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok " + scope["path"].encode()})

    s = Server(serve_config(http_port=0), repo=repo, extra_servicers=[], http_app=lambda state: app)
    s.start()
    try:
        assert " http=127.0.0.1:" in s.announce_line()
        with urllib.request.urlopen(f"http://{s.addresses.http}/v2", timeout=WAIT) as r:
            assert r.read() == b"ok /v2"
    finally:
        assert s.drain_and_stop(timeout=WAIT)


def test_recommend_without_a_deadline_is_answered(server, stub, tiny):
    """grpc reports 'no deadline' as ~9.2e18 s remaining; that must not overflow the clock."""
    reply = stub.Recommend(tiny.message(3, k=12))  # no timeout
    assert len(reply.item_ids) == 12
