"""Error answers stay short and readable whatever client text they quote
(``serving.types.error_message``), on every protocol, against real servers on 127.0.0.1: a filter
value of 16,000 characters (inside ``limits.max_filter_bytes``) and a raw id of 20,000 are
refused INVALID_ARGUMENT / 400 naming the field, where gRPC used to answer RESOURCE_EXHAUSTED
(its client refuses metadata past 8 KiB) and HTTP a 20 KB error."""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from common.logs import MAX_MESSAGE_CHARS
from serving.app.config import ServeConfig
from serving.app.server import Server
from serving.protos import admin_pb2 as apb
from serving.protos.admin_pb2_grpc import AdminStub
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository.repository import ModelRepository
from serving.sharding.config import RouterConfig
from serving.sharding.shard_server import ShardServer
from serving.types import DATATYPES
from support.raw_id_model import with_id_maps
from support.tiny_model import StandInRepo

WAIT = 10.0
LONG_VALUE = "P" * 16_000
FILTER = "category = " + LONG_VALUE  # 16,011 bytes: inside the 16 KiB filter limit
RAW_ID = "y" * 20_000
SHORT = MAX_MESSAGE_CHARS + 60
"""Longest message an answer may carry: the cut message and the cut's note."""


def check_short(message: str, field: str) -> None:
    assert len(message) <= SHORT, len(message)
    assert message.startswith(field) or f"{field}:" in message[:100], message[:200]
    assert "characters cut" in message


def recommend_error(address: str, msg) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as e:
        RecommenderStub(channel).Recommend(msg, timeout=WAIT)
    return e.value


def kserve_inputs(module, tiny, extra: dict[str, np.ndarray], drop: tuple[str, ...] = ()):
    tensors = {k: v for k, v in tiny.inputs(np.array([0])).items() if k not in drop}
    out = []
    for name, x in {**tensors, **extra}.items():
        t = module.InferInput(name, list(x.shape), DATATYPES[name])
        t.set_data_from_numpy(x)
        out.append(t)
    return out


@pytest.fixture
def served(serve_config, tmp_path, tiny) -> Iterator[Server]:
    """The tiny model with id maps, every front end and the admin API."""
    repo = StandInRepo()
    repo.publish(with_id_maps(tiny.model))
    config = serve_config(http_port=0, metrics_port=None, state_dir=tmp_path / "state")
    s = Server(config, repo=repo)  # plugins discovered: KServe gRPC and admin join
    s.start()
    yield s
    s.drain_and_stop(timeout=WAIT)


def test_recommend_answers_a_long_filter_value_and_raw_id_in_a_short_message(served, tiny):
    e = recommend_error(served.addresses.grpc, tiny.message(0, filter=FILTER))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()[:300]
    check_short(e.details(), "filter")
    msg = tiny.message(0)
    del msg.history[:]
    msg.raw_history[:] = [RAW_ID]
    e = recommend_error(served.addresses.grpc, msg)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()[:300]
    check_short(e.details(), "raw_history")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_kserve_answers_a_long_filter_value_and_raw_id_in_a_short_message(served, tiny, protocol):
    module = tg if protocol == "grpc" else th
    address = served.addresses.grpc if protocol == "grpc" else served.addresses.http
    client = module.InferenceServerClient(address)
    cases = [
        ("filter", {"filter": np.array([[FILTER.encode()]], dtype=object)}, ()),
        ("raw_history", {"raw_history": np.array([[RAW_ID.encode()]], dtype=object)}, ("history",)),
    ]
    try:
        for field, extra, drop in cases:
            with pytest.raises(InferenceServerException) as e:
                client.infer("demo", kserve_inputs(module, tiny, extra, drop))
            status = str(e.value.status())
            assert status in ("StatusCode.INVALID_ARGUMENT", "400"), (status, str(e.value)[:300])
            check_short(e.value.message(), field)
    finally:
        client.close()


def test_an_http_path_is_cut_in_a_404(served):
    host, port = served.addresses.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    conn.request("GET", "/v2/models/" + "m" * 10_000 + "/nowhere")
    response = conn.getresponse()
    body = response.read()
    conn.close()
    assert response.status == 404 and len(body) <= SHORT + 20, (response.status, len(body))


def test_the_admin_api_answers_a_long_attribute_value_in_a_short_message(served):
    with grpc.insecure_channel(served.addresses.grpc) as channel:
        item = apb.ItemAttributes(
            id=1, attributes=[apb.Attribute(name="category", values=[LONG_VALUE])]
        )
        with pytest.raises(grpc.RpcError) as e:
            AdminStub(channel).SetItemAttributes(
                apb.SetItemAttributesRequest(items=[item]), timeout=WAIT
            )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()[:300]
    check_short(e.value.details(), "items[0].attributes.category")


@pytest.fixture
def router(tiny, tmp_path) -> Iterator[Server]:
    """A router over two shard servers (real gRPC on 127.0.0.1), live updates on."""
    repo = ModelRepository(tmp_path / "repo")
    repo.publish("demo", tiny.model, shards=2)
    shards = [ShardServer(repo, "demo", i, poll_s=0) for i in range(2)]
    addresses = [s.start() for s in shards]
    server = Server(
        ServeConfig(
            model_repo=tmp_path / "repo",
            model="demo",
            grpc_port=0,
            poll_s=0,
            state_dir=tmp_path / "state",
            router=RouterConfig(shards=[[a] for a in addresses], shard_deadline_ms=5000.0),
        )
    )
    server.start()
    yield server
    server.drain_and_stop(timeout=WAIT)
    for s in shards:
        s.stop(0)


def test_a_router_answers_a_long_filter_value_and_attribute_in_a_short_message(router, tiny):
    e = recommend_error(router.addresses.grpc, tiny.message(0, filter=FILTER))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()[:300]
    check_short(e.details(), "filter")
    with grpc.insecure_channel(router.addresses.grpc) as channel:
        item = apb.ItemAttributes(
            id=1, attributes=[apb.Attribute(name="category", values=[LONG_VALUE])]
        )
        with pytest.raises(grpc.RpcError) as a:
            AdminStub(channel).SetItemAttributes(
                apb.SetItemAttributesRequest(items=[item]), timeout=WAIT
            )
    assert a.value.code() == grpc.StatusCode.INVALID_ARGUMENT, a.value.details()[:300]
    check_short(a.value.details(), "items[0].attributes.category")
