"""A call the token check refuses (``common.security``, before any front end runs) still counts:
an inference call — Recommend, KServe gRPC ``ModelInfer``, HTTP ``.../infer`` — is one failed
request, reason ``unauthenticated`` (Triton's ``OTHER``); health and metadata calls count
nothing, refused or not."""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator
from functools import partial

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from common.security import SecurityConfig
from serving.app.server import Server, is_inference
from serving.frontends import kserve_grpc
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.types import DATATYPES
from support.kserve_calls import post

WAIT = 10.0
TOKEN = "t0ken-for-the-refusal-metrics-5b8e2d"
WRONG = "wrong-token-for-the-refusal-metrics-9c1f"


@pytest.fixture
def server(serve_config, repo) -> Iterator[Server]:
    config = serve_config(security=SecurityConfig(token=TOKEN), http_port=0, metrics_port=None)
    s = Server(config, repo=repo, extra_servicers=[kserve_grpc.add_servicer])
    s.start()
    yield s
    s.drain_and_stop(timeout=WAIT)


@pytest.fixture
def channel(server: Server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.addresses.grpc) as c:
        yield c


def failures(server: Server) -> dict[str, float]:
    """Failed requests of version 1 by Triton's reason and ours, and the successes."""
    reg = server.metrics.registry
    labels = {"model": "demo", "version": "1"}
    out = {"success": reg.get_sample_value("nv_inference_request_success", labels) or 0.0}
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        value = reg.get_sample_value("nv_inference_request_failure", {**labels, "reason": reason})
        out[reason] = value or 0.0
    for reason in ("unauthenticated", "permission_denied"):
        value = reg.get_sample_value(
            "recserve_request_failures_total", {"model": "demo", "reason": reason}
        )
        out[reason] = value or 0.0
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in after.items() if v != before[k]}


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def infer_request(tiny) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name="demo")
    for name, a in tiny.inputs(np.array([1, 2])).items():
        request.inputs.add(name=name, datatype=DATATYPES[name], shape=list(a.shape))
        request.raw_input_contents.append(a.tobytes())
    return request


@pytest.mark.parametrize("token", [None, WRONG])
def test_a_refused_grpc_inference_call_is_one_unauthenticated_failure(server, channel, tiny, token):
    recommend = RecommenderStub(channel).Recommend
    infer = kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
    calls = {
        "Recommend": lambda md: recommend(tiny.message(1), timeout=WAIT, metadata=md),
        "ModelInfer": lambda md: infer(infer_request(tiny), timeout=WAIT, metadata=md),
    }
    for name, call in calls.items():
        before = failures(server)
        assert code_of(partial(call, metadata(token))) == grpc.StatusCode.UNAUTHENTICATED, name
        assert delta(before, failures(server)) == {"OTHER": 1, "unauthenticated": 1}, name
        before = failures(server)
        assert code_of(partial(call, metadata(TOKEN))) == grpc.StatusCode.OK, name
        assert delta(before, failures(server)) == {"success": 1}, name


@pytest.mark.parametrize("path", ["/v2/models/demo/infer", "/v2/models/demo/versions/1/infer"])
@pytest.mark.parametrize("token", [None, WRONG])
def test_a_refused_http_infer_is_one_unauthenticated_failure(server, path, token):
    before = failures(server)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    assert post(server, path, b'{"inputs": []}', headers)[0] == 401
    assert delta(before, failures(server)) == {"OTHER": 1, "unauthenticated": 1}


def test_refused_metadata_and_open_health_calls_count_nothing(server, channel):
    before = failures(server)
    kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
    meta = kpb.ModelMetadataRequest(name="demo")
    assert code_of(lambda: kserve.ModelMetadata(meta, timeout=WAIT)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT).status == (
        health_pb2.HealthCheckResponse.SERVING
    )
    assert kserve.ServerReady(kpb.ServerReadyRequest(), timeout=WAIT).ready
    conn = http.client.HTTPConnection(*server.addresses.http.split(":"), timeout=WAIT)
    try:
        for path, status in [("/v2/models/demo", 401), ("/v2/health/ready", 200)]:
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            assert response.status == status, path
    finally:
        conn.close()
    assert delta(before, failures(server)) == {}


def test_only_inference_methods_and_paths_are_requests():
    assert is_inference("/recserve.serving.v1.Recommender/Recommend")
    assert is_inference("/inference.GRPCInferenceService/ModelInfer")
    assert is_inference("/v2/models/demo/infer")
    assert is_inference("/v2/models/demo/versions/3/infer")
    for other in [
        "/inference.GRPCInferenceService/ModelMetadata",
        "/inference.GRPCInferenceService/ServerLive",
        "/grpc.health.v1.Health/Check",
        "/recserve.admin.v1.Admin/UpsertItems",
        "/v2/models/demo",
        "/v2/health/ready",
        "/v2/models/demo/infer/x",
        "/v2/repository/index",
    ]:
        assert not is_inference(other), other
