"""KServe v2 over HTTP in-process: ``serving.app.server.Server`` runs ``make_app`` in a real uvicorn
on 127.0.0.1 (the stand-in repository), and ``tritonclient.http`` talks to it unchanged."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.http as tc
from tritonclient.utils import InferenceServerException

from serving.app.config import BatchingConfig
from serving.app.server import Server
from serving.types import DATATYPES
from support.kserve_calls import post

WAIT = 10.0
USERS = [0, 3, 7, 42]


@pytest.fixture
def server(serve_config, repo) -> Iterator[Server]:
    config = serve_config(
        http_port=0,
        metrics_port=None,
        batching=BatchingConfig(max_batch_size=8, max_queue_delay_ms=1.0, max_queue_size=4),
    )
    s = Server(config, repo=repo, extra_servicers=[])
    s.start()
    yield s
    s.state.batcher.gate.set()
    s.drain_and_stop(timeout=WAIT)


@pytest.fixture
def client(server: Server) -> Iterator[tc.InferenceServerClient]:
    c = tc.InferenceServerClient(server.addresses.http, network_timeout=WAIT)
    yield c
    c.close()


def arrays(tiny, users: list[int], k: int = 10) -> dict[str, np.ndarray]:
    return tiny.inputs(np.array(users), k)


def to_inputs(a: dict[str, np.ndarray], binary: bool = True) -> list[tc.InferInput]:
    out = []
    for name, x in a.items():
        t = tc.InferInput(name, list(x.shape), DATATYPES[name])
        t.set_data_from_numpy(x, binary_data=binary)
        out.append(t)
    return out


def forward(tiny, users: list[int], k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    with torch.inference_mode():
        ids, scores = tiny.model(tiny.prep.user_batch(np.array(users)), k)
    return ids.numpy(), scores.numpy()


def test_binary_round_trip_equals_a_forward(client, tiny):
    a = arrays(tiny, USERS, k=12)
    a["filter"] = np.array([[b""]] * len(USERS), dtype=object)  # BYTES: empty is no filter
    result = client.infer("demo", to_inputs(a), request_id="r1")
    ids, scores = forward(tiny, USERS, 12)
    np.testing.assert_array_equal(result.as_numpy("item_ids"), ids)
    np.testing.assert_allclose(result.as_numpy("scores"), scores, rtol=1e-6)
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == (
        "demo",
        "1",
        "r1",
    )
    assert response["outputs"][0]["parameters"]["binary_data_size"] == ids.nbytes


def test_json_round_trip_and_requested_outputs(client, tiny):
    ask = [tc.InferRequestedOutput("item_ids", binary_data=False)]
    result = client.infer(
        "demo", to_inputs(arrays(tiny, USERS[:2]), binary=False), model_version="1", outputs=ask
    )
    assert result.as_numpy("scores") is None
    np.testing.assert_array_equal(result.as_numpy("item_ids"), forward(tiny, USERS[:2])[0])
    assert "data" in result.get_output("item_ids")
    for algorithm in ("gzip", "deflate"):  # compressed request bodies (tritonclient's option)
        result = client.infer(
            "demo", to_inputs(arrays(tiny, USERS[:2])), request_compression_algorithm=algorithm
        )
        np.testing.assert_array_equal(result.as_numpy("item_ids"), forward(tiny, USERS[:2])[0])


def test_a_compressed_body_is_limited_after_decompression(server):
    bomb = gzip.compress(b" " * (9 << 20))  # 9 MiB of spaces: a few KiB on the wire
    status, _, raw = post(server, "/v2/models/demo/infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and json.loads(raw)["error"].startswith("body: decompresses")
    status, _, raw = post(server, "/v2/models/demo/infer", b"x", {"Content-Encoding": "br"})
    assert status == 400 and json.loads(raw)["error"].startswith("Content-Encoding")


def test_a_plain_json_request_with_a_filter(server, tiny):
    a = arrays(tiny, [1, 2])
    body = {
        "inputs": [
            {"name": n, "datatype": DATATYPES[n], "shape": list(x.shape), "data": x.tolist()}
            for n, x in a.items()
        ]
        + [{"name": "filter", "datatype": "BYTES", "shape": [2, 1], "data": ["available", ""]}]
    }
    status, headers, raw = post(server, "/v2/models/demo/infer", json.dumps(body).encode())
    assert status == 200, raw
    assert "Inference-Header-Content-Length" not in headers
    out = {o["name"]: o for o in json.loads(raw)["outputs"]}
    assert out["item_ids"]["shape"] == [2, 10]
    ids = np.array(out["item_ids"]["data"]).reshape(2, 10)
    np.testing.assert_array_equal(ids[1], forward(tiny, [2])[0][0])
    attrs = tiny.prep.dataset.item_attributes
    assert (attrs["available"][ids[0][ids[0] >= 0]] == 1).all()


def test_health_metadata_and_config(client, server, tiny):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("demo") and client.is_model_ready("demo", "1")
    assert not client.is_model_ready("demo", "2") and not client.is_model_ready("other")
    meta = client.get_server_metadata()
    assert meta["name"] == "recserve" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("demo")
    assert (model["name"], model["versions"]) == ("demo", ["1"])
    f = len(tiny.prep.config.user_features)
    shapes = {t["name"]: (t["datatype"], t["shape"]) for t in model["inputs"]}
    assert shapes["categorical"] == ("INT64", [-1, f]) and shapes["k"] == ("INT32", [-1, 1])
    config = client.get_model_config("demo")  # built from the interface: the stand-in has none
    assert config["name"] == "demo" and config["max_batch_size"] == 8
    assert [i["name"] for i in config["input"]][:2] == ["history", "categorical"]
    assert config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 4
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("other")
    assert err.value.status() == "404" and err.value.message().startswith("model")
    with pytest.raises(InferenceServerException) as err:
        client.get_model_config("demo", "x")
    assert err.value.status() == "400" and err.value.message().startswith("version")
    status, _, body = post(server, "/v2/nowhere", b"")
    assert status == 404 and "error" in json.loads(body)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("missing", "dense"),
        ("dtype", "k"),
        ("shape", "categorical"),
        ("batch", "dense"),
        ("k", "k"),
        ("history", "history"),
    ],
)
def test_bad_inputs_are_400_naming_the_input(client, tiny, change, field):
    a = arrays(tiny, [1, 2])
    if change == "missing":
        del a["dense"]
    elif change == "shape":
        a["categorical"] = a["categorical"][:, :1].copy()
    elif change == "batch":
        a["dense"] = a["dense"][:1].copy()
    elif change == "k":
        a["k"][1] = 10**6
    elif change == "history":
        a["history"][0, 0] = -5
    inputs = to_inputs(a)
    if change == "dtype":
        inputs[3] = tc.InferInput("k", [2, 1], "INT64")
        inputs[3].set_data_from_numpy(a["k"].astype(np.int64))
    start = time.monotonic()
    with pytest.raises(InferenceServerException) as err:
        client.infer("demo", inputs)
    assert time.monotonic() - start < 1.0
    assert err.value.status() == "400"
    assert err.value.message().startswith(field), err.value.message()
    assert client.infer("demo", to_inputs(arrays(tiny, [1]))).as_numpy("item_ids").shape == (1, 10)


def infer_in_a_thread(server: Server, inputs: list[tc.InferInput]) -> tc.InferResult:
    """A blocking call from another thread (``async_infer``'s greenlets run only while the
    calling thread waits in gevent)."""
    c = tc.InferenceServerClient(server.addresses.http, network_timeout=WAIT)
    try:
        return c.infer("demo", inputs)
    finally:
        c.close()


def binary_body(tiny, cut: int = 0) -> tuple[bytes, dict[str, str]]:
    a = arrays(tiny, [1])
    blobs = [x.tobytes() for x in a.values()]
    header = {
        "inputs": [
            {
                "name": n,
                "datatype": DATATYPES[n],
                "shape": list(x.shape),
                "parameters": {"binary_data_size": len(b)},
            }
            for (n, x), b in zip(a.items(), blobs, strict=True)
        ],
        "parameters": {"binary_data_output": True},
    }
    text = json.dumps(header).encode()
    body = text + b"".join(blobs)
    return body[: len(body) - cut], {"Inference-Header-Content-Length": str(len(text))}


def test_the_binary_extension_by_hand(server, tiny):
    body, headers = binary_body(tiny)
    status, got, raw = post(server, "/v2/models/demo/versions/1/infer", body, headers)
    assert status == 200
    n = int(got["inference-header-content-length"])
    outputs = json.loads(raw[:n])["outputs"]
    size = outputs[0]["parameters"]["binary_data_size"]
    ids = np.frombuffer(raw[n : n + size], "<i8")
    np.testing.assert_array_equal(ids, forward(tiny, [1])[0][0])
    status, _, raw = post(server, "/v2/models/demo/infer", *binary_body(tiny, cut=4))
    assert status == 400 and json.loads(raw)["error"].startswith("k: binary_data_size 4")
    status, _, raw = post(
        server, "/v2/models/demo/infer", body, {"Inference-Header-Content-Length": "x"}
    )
    assert status == 400 and json.loads(raw)["error"].startswith("Inference-Header-Content-Length")
    status, _, raw = post(server, "/v2/models/demo/infer", b"{not json")
    assert status == 400 and json.loads(raw)["error"].startswith("body")


def test_unknown_model_oversized_body_queue_full_deadline_draining(client, server, tiny):
    with pytest.raises(InferenceServerException) as err:
        client.infer("other", to_inputs(arrays(tiny, [1])))
    assert err.value.status() == "404"
    with pytest.raises(InferenceServerException) as err:
        client.infer("demo", to_inputs(arrays(tiny, [1])), model_version="3")
    assert err.value.status() == "404"

    status, _, raw = post(server, "/v2/models/demo/infer", b" " * (9 << 20))
    assert status == 413 and json.loads(raw)["error"].startswith("body")

    batcher = server.state.batcher
    batcher.gate.clear()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(infer_in_a_thread, server, to_inputs(arrays(tiny, USERS[:3])))
        until = time.monotonic() + WAIT
        while batcher.waiting < 3 and time.monotonic() < until:
            time.sleep(0.01)
        with pytest.raises(InferenceServerException) as err:  # rows 4 and 5: one too many
            client.infer("demo", to_inputs(arrays(tiny, USERS[:2])))
        assert err.value.status() == "503" and err.value.message().startswith("queue full")
        batcher.gate.set()
        np.testing.assert_array_equal(
            held.result(timeout=WAIT).as_numpy("item_ids"), forward(tiny, USERS[:3])[0]
        )
    assert client.infer("demo", to_inputs(arrays(tiny, USERS[:2]))).as_numpy("item_ids") is not None

    batcher.gate.clear()
    with pytest.raises(InferenceServerException) as err:
        client.infer("demo", to_inputs(arrays(tiny, [1])), timeout=100_000)  # µs
    assert err.value.status() == "504"
    batcher.gate.set()

    server.state.draining.set()
    assert client.is_server_live() and not client.is_server_ready()
    with pytest.raises(InferenceServerException) as err:
        client.infer("demo", to_inputs(arrays(tiny, [1])))
    assert err.value.status() == "503" and "draining" in err.value.message()
