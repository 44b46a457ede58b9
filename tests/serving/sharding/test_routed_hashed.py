"""A hashed filter attribute (a creator of 5,000 values) served through a router over 2 shard
servers (real gRPC on loopback): answers equal the unsharded model's forward."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from retrieval.data import SyntheticConfig, generate
from retrieval.features import item_feature_ids
from retrieval.model import RetrievalModel
from retrieval.training.prepare import prepare
from serving.app.config import RouterConfig, ServeConfig
from serving.app.server import Server
from serving.repository.repository import ModelRepository
from serving.sharding.shard_server import ShardServer
from support.tiny_model import Tiny
from support.topk_check import assert_same_topk

CREATORS = [f"k{i}" for i in range(5000)]
EXPRESSIONS = [
    "creator in {k0, k7, k401}",
    "creator != k7 or category = news",
    "(creator in {k0, k401} or language = fr) and not creator = k7",
]


@pytest.fixture(scope="module")
def creators() -> Tiny:
    """2,000 items, each by one of 5,000 creators (most by a dozen of them), hashed."""
    prep = prepare(generate(SyntheticConfig(num_users=32, num_items=2000, seed=5)), history_len=8)
    prep.config = copy.deepcopy(prep.config)
    prep.config.item_attributes = {**prep.config.item_attributes, "creator": CREATORS}
    rng = np.random.default_rng(0)
    n = prep.dataset.num_items
    creator = np.where(
        rng.random(n) < 0.8, rng.choice([0, 7, 401, 9, 12], n), rng.integers(0, 5000, n)
    )
    prep.dataset.item_attributes = {**prep.dataset.item_attributes, "creator": creator}
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    attrs = prep.dataset.item_attributes
    model.build_index(item_feature_ids(attrs, n), attrs)
    assert model.index.schema.hashed_digits == {"creator": 4}
    return Tiny(prep, model.eval())


@pytest.fixture(scope="module")
def router(creators, tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    repo = ModelRepository(root)
    repo.publish("demo", creators.model, shards=2)
    shards = [ShardServer(repo, "demo", s, poll_s=0) for s in range(2)]
    cfg = RouterConfig(shards=[[s.start()] for s in shards], shard_deadline_ms=10_000.0)
    server = Server(ServeConfig(model_repo=root, model="demo", grpc_port=0, poll_s=0, router=cfg))
    server.start()
    yield server
    server.drain_and_stop(timeout=5)
    for s in shards:
        s.stop(0)


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_routed_hashed_answers_equal_unsharded(creators, router, text):
    users, k = np.arange(4), 25
    want_ids, want_scores = creators.expected(creators.model, users, k, [text] * len(users))
    assert (want_ids >= 0).any(), text
    assert router.state is not None
    for row, u in enumerate(users):
        res = router.state.submit(creators.request(int(u), k, filter=text)).result(timeout=30)
        assert not res.partial
        assert_same_topk(
            torch.from_numpy(res.item_ids[None]),
            torch.from_numpy(res.scores[None]),
            torch.from_numpy(want_ids[row : row + 1]),
            torch.from_numpy(want_scores[row : row + 1]),
        )
