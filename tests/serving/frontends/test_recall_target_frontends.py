"""A request's recall target through the front ends, in-process (a real server on 127.0.0.1 over
the stand-in repository): Recommend ``recall_target`` and the KServe v2 request parameter
``recall_target`` (``tritonclient.grpc`` / ``.http``). Each answer equals the in-process model
asked the same; 1 is the exact answer; bad targets, and targets a model cannot read (no recall
curve), are refused naming the field."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from retrieval.index.build import tune_nprobe
from retrieval.index.stats import IndexStats
from retrieval.model import RetrievalModel
from serving.app.config import BatchingConfig
from serving.app.server import Server
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.types import DATATYPES
from support.tiny_model import Tiny, start_server
from support.topk_check import assert_same_topk

WAIT = 10.0
USERS = [0, 3, 7, 42]


@pytest.fixture(scope="module")
def tuned(tiny: Tiny) -> RetrievalModel:
    """The tiny model with its recall curve measured (a copy: the session's model stays)."""
    m = copy.deepcopy(tiny.model).eval()
    m.index.config.target_recall = 0.9
    with torch.inference_mode():
        q = m.user_vectors(tiny.prep.user_batch(np.arange(64)))
    tune_nprobe(m.index, q)
    assert m.index.stats.recall_curve
    return m


def _serve(serve_config, model: RetrievalModel) -> Server:
    batching = BatchingConfig(max_batch_size=8, max_queue_delay_ms=2.0, max_queue_size=64)
    return start_server(serve_config(http_port=0, metrics_port=None, batching=batching), model)


@pytest.fixture
def server(serve_config, tuned) -> Iterator[Server]:
    s = _serve(serve_config, tuned)
    yield s
    s.drain_and_stop(timeout=WAIT)


def _asked(tiny: Tiny, model: RetrievalModel, users: list[int], target: float, k: int = 10):
    """The in-process answer of ``users`` asking ``target``: ``(ids [B, K], scores [B, K])``."""
    batch = tiny.prep.user_batch(np.array(users))
    batch.recall_target = torch.full((len(users),), target)
    with torch.inference_mode():
        return model(batch, k)


@pytest.mark.parametrize("target", [0.5, 0.9, 1.0])
def test_recommend_answers_as_the_model_asked_the_same(server, tiny, tuned, target):
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        stub = RecommenderStub(channel)
        for row, user in enumerate(USERS):
            reply = stub.Recommend(tiny.message(user, recall_target=target), timeout=WAIT)
            want_ids, want_scores = _asked(tiny, tuned, USERS, target)
            got = torch.tensor(list(reply.item_ids))[None], torch.tensor(list(reply.scores))[None]
            assert_same_topk(*got, want_ids[row : row + 1], want_scores[row : row + 1])
    with torch.inference_mode():  # 1: the exact answer
        exact = tuned(tiny.prep.user_batch(np.array(USERS)), 10, exact=True)[0]
    assert torch.equal(_asked(tiny, tuned, USERS, 1.0)[0], exact)


def _inputs(tiny: Tiny, mod: Any) -> list:
    out = []
    for name, a in tiny.inputs(np.array(USERS), 10).items():
        t = mod.InferInput(name, list(a.shape), DATATYPES[name])
        t.set_data_from_numpy(a)
        out.append(t)
    return out


@pytest.mark.parametrize("mod", [tg, th], ids=["grpc", "http"])
def test_kserve_parameter_sets_every_rows_target(server, tiny, tuned, mod):
    address = server.addresses.grpc if mod is tg else server.addresses.http
    client: Any = mod.InferenceServerClient(address)
    try:
        for target in (0.5, 1.0):
            result = client.infer("demo", _inputs(tiny, mod), parameters={"recall_target": target})
            want_ids, want_scores = _asked(tiny, tuned, USERS, target)
            got = result.as_numpy("item_ids").copy(), result.as_numpy("scores").copy()
            assert_same_topk(
                torch.from_numpy(got[0]), torch.from_numpy(got[1]), want_ids, want_scores
            )
        with pytest.raises(InferenceServerException, match="recall_target must be a number"):
            client.infer("demo", _inputs(tiny, mod), parameters={"recall_target": 1.5})
    finally:
        client.close()


def test_targets_are_refused_naming_the_field(serve_config, server, tiny):
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        with pytest.raises(grpc.RpcError) as err:
            RecommenderStub(channel).Recommend(tiny.message(0, recall_target=1.5), timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("recall_target: must be in (0, 1]")
    bare = copy.deepcopy(tiny.model).eval()
    bare.index.stats = IndexStats()  # as built without target_recall
    plain = _serve(serve_config, bare)
    try:
        with grpc.insecure_channel(plain.addresses.grpc) as channel:
            stub = RecommenderStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Recommend(tiny.message(0, recall_target=0.9), timeout=WAIT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "measured no recall curve" in err.value.details()
            assert stub.Recommend(tiny.message(0, recall_target=1.0), timeout=WAIT).item_ids
    finally:
        plain.drain_and_stop(timeout=WAIT)
