"""Triton's counting, over every front end of one in-process server (Recommend gRPC, KServe v2
gRPC and HTTP): a call is one request however many rows it holds (``nv_inference_request_*``),
its rows are inferences (``nv_inference_count``), and every refusal — while parsing too — is one
failure, with Triton's reason and ours (``recserve_request_failures_total``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from serving.app.config import BatchingConfig
from serving.app.server import Server
from serving.protos import recommend_pb2_grpc
from serving.types import DATATYPES
from support.kserve_calls import post

WAIT = 10.0
INFER = "/v2/models/demo/infer"


@pytest.fixture
def server(serve_config, repo) -> Iterator[Server]:
    config = serve_config(
        http_port=0,
        metrics_port=None,
        batching=BatchingConfig(max_batch_size=8, max_queue_delay_ms=1.0, max_queue_size=4),
    )
    s = Server(config, repo=repo)  # plugins discovered: KServe gRPC joins
    s.start()
    yield s
    s.state.batcher.gate.set()
    s.drain_and_stop(timeout=WAIT)


@pytest.fixture
def channel(server: Server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.addresses.grpc) as c:
        yield c


@pytest.fixture
def client(server: Server) -> Iterator[tc.InferenceServerClient]:
    c = tc.InferenceServerClient(server.addresses.grpc)
    yield c
    c.close()


def counts(server: Server) -> dict[str, float]:
    """Every request counter of ``server``, version 1, failures by Triton's and our reason."""
    reg = server.metrics.registry
    labels = {"model": "demo", "version": "1"}
    out = {
        name: reg.get_sample_value(f"nv_inference_{name}", labels) or 0.0
        for name in ("request_success", "count", "exec_count")
    }
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        value = reg.get_sample_value("nv_inference_request_failure", {**labels, "reason": reason})
        out[reason] = value or 0.0
    for family in reg.collect():
        if family.name == "recserve_request_failures":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["reason"]] = s.value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def json_body(tiny, users: list[int], k: int = 10) -> bytes:
    tensors = [
        {"name": n, "datatype": DATATYPES[n], "shape": list(a.shape), "data": a.ravel().tolist()}
        for n, a in tiny.inputs(np.array(users), k).items()
    ]
    return json.dumps({"inputs": tensors}).encode()


def grpc_inputs(tiny, users: list[int], k: int = 10) -> list[tc.InferInput]:
    out = []
    for name, a in tiny.inputs(np.array(users), k).items():
        t = tc.InferInput(name, list(a.shape), DATATYPES[name])
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def test_a_call_of_three_rows_is_one_request_and_three_inferences(server, client, channel, tiny):
    before = counts(server)
    status, _, _ = post(server, INFER, json_body(tiny, [0, 3, 7]))
    assert status == 200
    client.infer("demo", grpc_inputs(tiny, [1, 2, 4]))
    recommend_pb2_grpc.RecommenderStub(channel).Recommend(tiny.message(5), timeout=WAIT)
    got = delta(before, counts(server))
    assert got.pop("request_success") == 3  # HTTP, KServe gRPC, Recommend: one each
    assert got.pop("count") == 7  # their rows
    assert 1 <= got.pop("exec_count") <= 7  # forwards: rows of one call may share one
    assert got == {}  # no failure


def bad_tensor_body(tiny) -> bytes:
    doc = json.loads(json_body(tiny, [0, 3]))
    doc["inputs"][2]["datatype"] = "FP64"  # dense
    return json.dumps(doc).encode()


HTTP_REFUSALS: dict[str, tuple[Callable, int, str]] = {
    "bad json": (lambda s, tiny: post(s, INFER, b'{"inputs": ['), 400, "invalid_argument"),
    "bad tensor": (lambda s, tiny: post(s, INFER, bad_tensor_body(tiny)), 400, "invalid_argument"),
    "unknown model": (
        lambda s, tiny: post(s, "/v2/models/other/infer", json_body(tiny, [0])),
        404,
        "not_found",
    ),
    "too large": (  # refused on its Content-Length, before the body is read
        lambda s, tiny: post(s, INFER, b"{}", {"Content-Length": str(9 << 20)}),
        413,
        "too_large",
    ),
}


@pytest.mark.parametrize("case", sorted(HTTP_REFUSALS))
def test_an_http_refusal_is_one_failure_with_its_reason(server, tiny, case):
    send, status, reason = HTTP_REFUSALS[case]
    before = counts(server)
    assert send(server, tiny)[0] == status
    assert delta(before, counts(server)) == {"OTHER": 1, reason: 1}


def infer_raw(channel: grpc.Channel, body: bytes) -> None:
    """Bytes that are no ``ModelInferRequest`` (field 1, model_name, a string, not UTF-8)."""
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    call(body, timeout=WAIT)


def recommend_raw(channel: grpc.Channel, body: bytes) -> None:
    call = channel.unary_unary("/recserve.serving.v1.Recommender/Recommend")
    call(body, timeout=WAIT)


def short_dense(tiny) -> list[tc.InferInput]:
    ins = grpc_inputs(tiny, [1, 2])
    ins[2]._raw_content = ins[2]._raw_content[:-4]  # dense: one float short
    return ins


GRPC_REFUSALS: dict[str, tuple[Callable, grpc.StatusCode, str]] = {
    "kserve bad bytes": (
        lambda client, channel, tiny: infer_raw(channel, b"\x0a\x02\xff\xfe"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "invalid_argument",
    ),
    "kserve bad tensor": (
        lambda client, channel, tiny: client.infer("demo", short_dense(tiny)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "invalid_argument",
    ),
    "kserve unknown model": (
        lambda client, channel, tiny: client.infer("other", grpc_inputs(tiny, [1, 2])),
        grpc.StatusCode.NOT_FOUND,
        "not_found",
    ),
    "recommend bad field": (
        lambda client, channel, tiny: recommend_pb2_grpc.RecommenderStub(channel).Recommend(
            tiny.message(0, k=0), timeout=WAIT
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "invalid_argument",
    ),
    "recommend bad bytes": (
        lambda client, channel, tiny: recommend_raw(channel, b"\x0a\x02\xff\xfe"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "invalid_argument",
    ),
    "recommend unknown model": (
        lambda client, channel, tiny: recommend_pb2_grpc.RecommenderStub(channel).Recommend(
            tiny.message(0, model="other"), timeout=WAIT
        ),
        grpc.StatusCode.NOT_FOUND,
        "not_found",
    ),
}


@pytest.mark.parametrize("case", sorted(GRPC_REFUSALS))
def test_a_grpc_refusal_is_one_failure_with_its_reason(server, client, channel, tiny, case):
    send, code, reason = GRPC_REFUSALS[case]
    before = counts(server)
    with pytest.raises((grpc.RpcError, InferenceServerException)) as err:
        send(client, channel, tiny)
    got = err.value.code() if isinstance(err.value, grpc.RpcError) else err.value.status()
    assert got in (code, f"StatusCode.{code.name}")
    assert delta(before, counts(server)) == {"OTHER": 1, reason: 1}


def wait_queued(server: Server, n: int) -> None:
    until = time.monotonic() + WAIT
    while server.state.batcher.waiting < n and time.monotonic() < until:
        time.sleep(0.01)
    assert server.state.batcher.waiting == n


def test_queue_full_deadline_and_draining_count_once_per_call(server, client, tiny):
    batcher = server.state.batcher
    batcher.gate.clear()
    held: list = []
    client.async_infer(
        "demo", grpc_inputs(tiny, [0, 3, 7]), lambda result, error: held.append(error)
    )
    wait_queued(server, 3)
    before = counts(server)
    with pytest.raises(InferenceServerException, match="queue full"):  # rows 4 and 5 of 4
        client.infer("demo", grpc_inputs(tiny, [1, 2]), client_timeout=WAIT)
    assert delta(before, counts(server)) == {"REJECTED": 1, "queue_full": 1}

    before = counts(server)
    with pytest.raises(InferenceServerException) as err:  # the one row left waits past 0.1 s
        client.infer("demo", grpc_inputs(tiny, [1]), timeout=100_000)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert delta(before, counts(server)) == {"REJECTED": 1, "deadline_exceeded": 1}
    batcher.gate.set()
    until = time.monotonic() + WAIT
    while not held and time.monotonic() < until:
        time.sleep(0.01)
    assert held == [None]

    server.state.draining.set()
    before = counts(server)
    status, _, _ = post(server, INFER, json_body(tiny, [0, 3]))
    assert status == 503
    assert delta(before, counts(server)) == {"OTHER": 1, "unavailable": 1}
