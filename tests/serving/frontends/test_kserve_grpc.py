"""KServe v2 over gRPC in-process: a real server on 127.0.0.1 (``serving.app.server.Server`` over the
stand-in repository) and ``tritonclient.grpc`` unchanged."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import tritonclient.grpc as tc
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from retrieval.features import make_user_batch
from serving.app.config import BatchingConfig
from serving.app.frontends import GRPC_SERVICES
from serving.app.server import Server
from serving.frontends import kserve_grpc
from serving.types import DATATYPES

WAIT = 10.0
USERS = [0, 3, 7, 42]


class ConfiguredRepo:
    """The stand-in repository, with a ``config.pbtxt`` on every loaded version."""

    def __init__(self, repo, config: mc.ModelConfig):
        self.repo, self.config = repo, config

    def latest(self, name: str) -> int | None:
        return self.repo.latest(name)

    def versions(self, name: str) -> list[int]:
        return self.repo.versions(name)

    def load(self, name: str, version: int | None = None):
        loaded = self.repo.load(name, version)
        loaded.config = self.config
        return loaded


def pbtxt() -> mc.ModelConfig:
    return mc.ModelConfig(name="demo", backend="python", max_batch_size=8)


@pytest.fixture
def server(serve_config, repo) -> Iterator[Server]:
    config = serve_config(
        metrics_port=None,
        batching=BatchingConfig(max_batch_size=8, max_queue_delay_ms=1.0, max_queue_size=4),
    )
    s = Server(config, repo=ConfiguredRepo(repo, pbtxt()))  # plugins discovered: KServe joins
    s.start()
    yield s
    s.state.batcher.gate.set()
    s.drain_and_stop(timeout=WAIT)


@pytest.fixture
def client(server: Server) -> Iterator[tc.InferenceServerClient]:
    c = tc.InferenceServerClient(server.addresses.grpc)
    yield c
    c.close()


def inputs(tiny, users: list[int], k: int = 10, filters: list[str] | None = None):
    arrays = tiny.inputs(np.array(users), k)
    if filters is not None:
        arrays["filter"] = np.array(filters, dtype=object).reshape(-1, 1)
    return arrays


def to_inputs(arrays: dict[str, np.ndarray], datatypes: dict[str, str] | None = None):
    out = []
    for name, a in arrays.items():
        dt = (datatypes or {}).get(name) or DATATYPES[name]
        t = tc.InferInput(name, list(a.shape), dt)
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def forward(tiny, users: list[int], k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    with torch.inference_mode():
        ids, scores = tiny.model(tiny.prep.user_batch(np.array(users)), k)
    return ids.numpy(), scores.numpy()


def test_the_service_is_registered():
    assert kserve_grpc.add_servicer in GRPC_SERVICES


def test_model_infer_round_trip_equals_a_forward(client, tiny):
    result = client.infer("demo", to_inputs(inputs(tiny, USERS, k=12)), request_id="r1")
    ids, scores = forward(tiny, USERS, 12)
    np.testing.assert_array_equal(result.as_numpy("item_ids"), ids)
    np.testing.assert_allclose(result.as_numpy("scores"), scores, rtol=1e-6)
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("demo", "1", "r1")
    # one output asked for; the model pinned by version; a deadline
    result = client.infer(
        "demo",
        to_inputs(inputs(tiny, USERS[:1], k=5)),
        model_version="1",
        outputs=[tc.InferRequestedOutput("item_ids")],
        client_timeout=WAIT,
    )
    assert result.as_numpy("scores") is None
    np.testing.assert_array_equal(result.as_numpy("item_ids"), forward(tiny, USERS[:1], 5)[0])


def test_a_filter_applies_per_row(client, tiny):
    filters = ["language in {en, fr} and available", ""]
    result = client.infer("demo", to_inputs(inputs(tiny, [1, 2], filters=filters)))
    a = inputs(tiny, [1, 2])
    batch = make_user_batch(
        a["history"], a["categorical"], a["dense"], tiny.model.index.schema, [filters[0], None]
    )
    with torch.inference_mode():
        ids, _ = tiny.model(batch, 10)
    np.testing.assert_array_equal(result.as_numpy("item_ids"), ids.numpy())
    attrs, values = tiny.prep.dataset.item_attributes, tiny.prep.dataset.attribute_values
    row = result.as_numpy("item_ids")[0]
    row = row[row >= 0]
    assert set(attrs["language"][row]) <= {values["language"].index(v) for v in ("en", "fr")}


def test_metadata_config_and_health(client, server, tiny):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("demo") and client.is_model_ready("demo", "1")
    assert not client.is_model_ready("demo", "2") and not client.is_model_ready("other")
    meta = client.get_server_metadata()
    assert meta.name == "recserve" and "binary_tensor_data" in meta.extensions
    model = client.get_model_metadata("demo")
    assert (model.name, list(model.versions)) == ("demo", ["1"])
    shapes = {t.name: (t.datatype, list(t.shape)) for t in model.inputs}
    f, d = len(tiny.prep.config.user_features), tiny.prep.config.dense_dim
    assert shapes == {
        "history": ("INT64", [-1, -1]),
        "categorical": ("INT64", [-1, f]),
        "dense": ("FP32", [-1, d]),
        "k": ("INT32", [-1, 1]),
        "filter": ("BYTES", [-1, 1]),
        "seen": ("INT64", [-1, -1]),
    }
    assert [t.name for t in model.outputs] == ["item_ids", "scores"]
    assert client.get_model_config("demo").config == pbtxt()  # the loaded version's
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("other")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as err:
        client.get_model_config("demo", "7")
    assert err.value.status() == "StatusCode.NOT_FOUND"


def bad(tiny, change: str):
    arrays = inputs(tiny, [1, 2])
    datatypes: dict[str, str] = {}
    if change == "missing":
        del arrays["dense"]
    elif change == "extra":
        arrays["bogus"] = arrays["k"]
        datatypes["bogus"] = "INT32"
    elif change == "dtype":
        datatypes["k"] = "INT64"
        arrays["k"] = arrays["k"].astype(np.int64)
    elif change == "shape":
        arrays["categorical"] = arrays["categorical"][:, :1].copy()
    elif change == "batch":
        arrays["dense"] = arrays["dense"][:1].copy()
    elif change == "k":
        arrays["k"][1] = 0
    elif change == "filter":
        arrays["filter"] = np.array([["language in {en"], [""]], dtype=object)
    elif change == "history":
        arrays["history"][0, 0] = 10**6
    return to_inputs(arrays, datatypes)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("missing", "dense"),
        ("extra", "inputs"),
        ("dtype", "k"),
        ("shape", "categorical"),
        ("batch", "dense"),
        ("k", "k"),
        ("filter", "filter"),
        ("history", "history"),
    ],
)
def test_bad_inputs_are_invalid_argument_naming_the_input(client, tiny, change, field):
    start = time.monotonic()
    with pytest.raises(InferenceServerException) as err:
        client.infer("demo", bad(tiny, change), client_timeout=WAIT)
    assert time.monotonic() - start < 1.0
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert err.value.message().startswith(field), err.value.message()
    assert client.infer("demo", to_inputs(inputs(tiny, [1]))).as_numpy("item_ids").shape == (1, 10)


def test_byte_size_mismatch_and_unknown_model(client, tiny):
    ins = to_inputs(inputs(tiny, [1]))
    ins[2]._raw_content = ins[2]._raw_content[:-4]  # dense: one float short
    with pytest.raises(InferenceServerException) as err:
        client.infer("demo", ins)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert err.value.message().startswith("dense: raw contents hold")
    for name, version in (("other", ""), ("demo", "2")):
        with pytest.raises(InferenceServerException) as err:
            client.infer(name, to_inputs(inputs(tiny, [1])), model_version=version)
        assert err.value.status() == "StatusCode.NOT_FOUND"


def test_queue_overflow_rejects_the_call_that_overflows(client, server, tiny):
    batcher = server.state.batcher
    batcher.gate.clear()
    held: list = []
    client.async_infer(
        "demo",
        to_inputs(inputs(tiny, USERS[:3])),
        lambda result, error: held.append((result, error)),
    )
    until = time.monotonic() + WAIT
    while batcher.waiting < 3 and time.monotonic() < until:
        time.sleep(0.01)
    with pytest.raises(InferenceServerException) as err:  # rows 4 and 5: 5 is one too many
        client.infer("demo", to_inputs(inputs(tiny, USERS[:2])), client_timeout=WAIT)
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    batcher.gate.set()
    until = time.monotonic() + WAIT
    while not held and time.monotonic() < until:
        time.sleep(0.01)
    ((result, error),) = held
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("item_ids"), forward(tiny, USERS[:3])[0])
    assert client.infer("demo", to_inputs(inputs(tiny, USERS[:2]))).as_numpy("item_ids") is not None


def test_deadline_and_draining(client, server, tiny):
    batcher = server.state.batcher
    batcher.gate.clear()
    with pytest.raises(InferenceServerException) as err:  # Triton's timeout parameter (µs)
        client.infer("demo", to_inputs(inputs(tiny, [1])), timeout=100_000)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    with pytest.raises(InferenceServerException) as err:  # the call's own deadline
        client.infer("demo", to_inputs(inputs(tiny, [1])), client_timeout=0.2)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    batcher.gate.set()
    server.state.draining.set()
    assert client.is_server_live() and not client.is_server_ready()
    assert not client.is_model_ready("demo")
    with pytest.raises(InferenceServerException) as err:
        client.infer("demo", to_inputs(inputs(tiny, [1])))
    assert err.value.status() == "StatusCode.UNAVAILABLE"


def test_a_partial_answer_names_the_missing_shards_in_its_parameters():
    from tritonclient.grpc import service_pb2

    from serving.types import RecResult

    ids, scores = np.array([3, 1], np.int64), np.array([0.5, 0.4], np.float32)
    results = [
        RecResult(ids, scores, "demo", 2, partial=True, missing=["shard-1"]),
        RecResult(ids, scores, "demo", 2),
    ]
    out = kserve_grpc.render_response(
        service_pb2.ModelInferRequest(id="r1"), results, ["item_ids", "scores"]
    )
    assert out.parameters["partial"].bool_param
    assert out.parameters["missing"].string_param == "shard-1"
