"""Filter expressions (or, not, numeric ranges) served: through Recommend on one server and
through a router over 2 shard servers (real gRPC on loopback), equal to the unsharded model's
forward."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch

from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.training.prepare import prepare
from serving.app.config import RouterConfig, ServeConfig
from serving.app.server import Server
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository.repository import ModelRepository
from serving.sharding.shard_server import ShardServer
from support.tiny_model import StandInRepo, Tiny
from support.topk_check import assert_same_topk

EXPRESSIONS = [
    "(category = news or language = fr) and price < 20",
    "price between 5 and 30 or (available and region in {eu, na})",
    "not (price < 3 or price > 40) and not category = news",
    "not (price >= 10) and (language in {en, de} or category = sports)",
    # a negated category inside an 'or' on the multi-valued region ("not blocked, or followed")
    "(region != eu or category = news) and (region != na or price < 15)",
]


@pytest.fixture(scope="module")
def priced() -> Tiny:
    """2,000 items with a numeric ``price`` besides the synthetic attributes, ``region``
    multi-valued in the index (an item offered in several regions)."""
    prep = prepare(generate(SyntheticConfig(num_users=32, num_items=2000, seed=5)), history_len=8)
    prep.config = copy.deepcopy(prep.config)
    prep.config.numeric_attributes = ("price",)
    rng = np.random.default_rng(0)
    n = prep.dataset.num_items
    price = np.round(rng.gamma(2.0, 10.0, n), 2)
    regions = rng.random((n, len(prep.config.item_attributes["region"]))) < 0.4
    attrs = {**prep.dataset.item_attributes, "price": price, "region": regions}
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, attrs)
    return Tiny(prep, model.eval())


def test_the_index_compares_prices_exactly(priced):
    ids, _ = priced.model.index.search(
        torch.randn(2, priced.model.config.out_dim), 50, "price < 20"
    )
    assert (ids >= 0).all()  # gamma(2, 10): about 60 % of the items are under 20


@pytest.fixture(scope="module")
def stub(priced, tmp_path_factory) -> Iterator[RecommenderStub]:
    root = tmp_path_factory.mktemp("one")
    (root / "demo").mkdir()
    (root / "demo" / "config.pbtxt").write_text('name: "demo"\n')
    repo = StandInRepo()
    repo.publish(priced.model)
    cfg = ServeConfig(model_repo=root, model="demo", grpc_port=0, metrics_port=0, poll_s=0.0)
    server = Server(cfg, repo=repo)
    server.start()
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        yield RecommenderStub(channel)
    server.drain_and_stop(timeout=5)


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_recommend_answers_an_expression_as_the_forward_does(priced, stub, text):
    users, k = np.arange(4), 25
    want_ids, want_scores = priced.expected(priced.model, users, k, [text] * len(users))
    for row, u in enumerate(users):
        reply = stub.Recommend(priced.message(int(u), k=k, filter=text), timeout=10)
        assert list(reply.item_ids) == want_ids[row].tolist(), text
        np.testing.assert_allclose(reply.scores, want_scores[row], rtol=1e-5)


@pytest.fixture(scope="module")
def router(priced, tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    repo = ModelRepository(root)
    repo.publish("demo", priced.model, shards=2)
    shards = [ShardServer(repo, "demo", s, poll_s=0) for s in range(2)]
    cfg = RouterConfig(shards=[[s.start()] for s in shards], shard_deadline_ms=10_000.0)
    server = Server(ServeConfig(model_repo=root, model="demo", grpc_port=0, poll_s=0, router=cfg))
    server.start()
    yield server
    server.drain_and_stop(timeout=5)
    for s in shards:
        s.stop(0)


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_routed_expression_answers_equal_unsharded(priced, router, text):
    users, k = np.arange(4), 25
    want_ids, want_scores = priced.expected(priced.model, users, k, [text] * len(users))
    assert router.state is not None
    for row, u in enumerate(users):
        res = router.state.submit(priced.request(int(u), k, filter=text)).result(timeout=30)
        assert not res.partial
        assert_same_topk(
            torch.from_numpy(res.item_ids[None]),
            torch.from_numpy(res.scores[None]),
            torch.from_numpy(want_ids[row : row + 1]),
            torch.from_numpy(want_scores[row : row + 1]),
        )
