"""A model with a seen store served in-process (a real server on 127.0.0.1 over the stand-in
repository): a request that names its ``user`` (Recommend field, KServe v2 input over
``tritonclient.grpc`` / ``.http``) is answered exactly like one that sends the user's seen list;
``config.pbtxt`` and the metadata declare ``user`` for such a model only; a model without a
store refuses it naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from retrieval.model import RetrievalModel
from serving.app.config import BatchingConfig
from serving.app.server import Server
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository.config import make_config
from serving.types import DATATYPES
from support.tiny_model import Tiny, start_server
from support.topk_check import assert_same_topk

WAIT = 10.0
USERS = [0, 3, 7, 42]


@pytest.fixture(scope="module")
def stored(tiny: Tiny) -> RetrievalModel:
    return tiny.with_seen_store()


def _serve(serve_config, model: RetrievalModel) -> Server:
    batching = BatchingConfig(max_batch_size=8, max_queue_delay_ms=2.0, max_queue_size=64)
    return start_server(serve_config(http_port=0, metrics_port=None, batching=batching), model)


@pytest.fixture
def server(serve_config, stored) -> Iterator[Server]:
    s = _serve(serve_config, stored)
    yield s
    s.drain_and_stop(timeout=WAIT)


def _named(tiny: Tiny, user: int) -> Any:
    """``user``'s Recommend request naming its user (and sending no seen list)."""
    msg = tiny.message(user)
    msg.user = user
    return msg


def _sent(tiny: Tiny, model: RetrievalModel, users: list[int], k: int = 10):
    """The in-process answer of ``users`` sending their seen lists."""
    batch = tiny.prep.user_batch(np.array(users), seen=tiny.prep.seen)
    with torch.inference_mode():
        return model(batch, k)


def test_recommend_with_a_user_equals_sending_its_list(server, tiny, stored):
    want_ids, want_scores = _sent(tiny, stored, USERS)
    plain = tiny.expected(stored, np.array(USERS), 10)[0]
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        stub = RecommenderStub(channel)
        for row, user in enumerate(USERS):
            reply = stub.Recommend(_named(tiny, user), timeout=WAIT)
            got = torch.tensor(list(reply.item_ids))[None], torch.tensor(list(reply.scores))[None]
            assert_same_topk(*got, want_ids[row : row + 1], want_scores[row : row + 1])
    assert not np.array_equal(want_ids.numpy(), plain)  # the stored lists matter


@pytest.mark.parametrize("mod", [tg, th], ids=["grpc", "http"])
def test_kserve_user_input_equals_sending_the_list(server, tiny, stored, mod):
    address = server.addresses.grpc if mod is tg else server.addresses.http
    client: Any = mod.InferenceServerClient(address)
    arrays = {**tiny.inputs(np.array(USERS)), "user": np.array(USERS, dtype=np.int64)[:, None]}
    inputs = []
    for name, a in arrays.items():
        t = mod.InferInput(name, list(a.shape), DATATYPES[name])
        t.set_data_from_numpy(a)
        inputs.append(t)
    try:
        result = client.infer("demo", inputs)
        want_ids, want_scores = _sent(tiny, stored, USERS)
        ids, scores = result.as_numpy("item_ids").copy(), result.as_numpy("scores").copy()
        assert_same_topk(torch.from_numpy(ids), torch.from_numpy(scores), want_ids, want_scores)
    finally:
        client.close()


def test_a_user_of_minus_one_means_none_on_recommend_and_kserve_alike(server, tiny, stored):
    plain = tiny.expected(stored, np.array(USERS[:1]), 10)[0][0].tolist()
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        stub = RecommenderStub(channel)
        msg = tiny.message(USERS[0])
        msg.user = -1
        assert list(stub.Recommend(msg, timeout=WAIT).item_ids) == plain
        msg.user = -2
        with pytest.raises(grpc.RpcError) as err:
            stub.Recommend(msg, timeout=WAIT)
    refused = "user: a user index is >= 0 (-1: none), got -2"
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details() == refused
    client = tg.InferenceServerClient(server.addresses.grpc)
    try:
        for user, want in ((-1, None), (-2, refused)):
            arrays = {**tiny.inputs(np.array(USERS[:1])), "user": np.array([[user]], np.int64)}
            inputs = []
            for name, a in arrays.items():
                t = tg.InferInput(name, list(a.shape), DATATYPES[name])
                t.set_data_from_numpy(a)
                inputs.append(t)
            if want is None:
                assert client.infer("demo", inputs).as_numpy("item_ids")[0].tolist() == plain
            else:
                with pytest.raises(InferenceServerException) as kerr:
                    client.infer("demo", inputs)
                assert kerr.value.message().startswith(want)
    finally:
        client.close()


def test_config_declares_user_only_with_a_store(tiny, stored):
    with_store = {t.name: t.optional for t in make_config("demo", stored.config).input}
    without = {t.name for t in make_config("demo", tiny.model.config).input}
    assert with_store["user"] is True and "user" not in without


def test_a_model_without_a_store_refuses_user(serve_config, tiny):
    plain = _serve(serve_config, tiny.model)
    try:
        with (
            grpc.insecure_channel(plain.addresses.grpc) as channel,
            pytest.raises(grpc.RpcError) as err,
        ):
            RecommenderStub(channel).Recommend(_named(tiny, 3), timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("user: demo version 1 keeps no seen store")
        client = tg.InferenceServerClient(plain.addresses.grpc)
        t = tg.InferInput("user", [1, 1], "INT64")
        t.set_data_from_numpy(np.array([[3]], dtype=np.int64))
        with pytest.raises(InferenceServerException, match="unexpected input 'user'"):
            client.infer("demo", [t])
        client.close()
    finally:
        plain.drain_and_stop(timeout=WAIT)
