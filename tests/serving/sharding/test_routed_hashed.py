"""A hashed filter attribute (a creator of 5,000 values) served through a router over 2 shard
servers (real gRPC on loopback): answers equal the unsharded model's forward."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from retrieval.data import SyntheticConfig, generate
from retrieval.features import item_feature_ids
from retrieval.index.split import shard_of
from retrieval.live_updates import UpsertItems, apply_update
from retrieval.model import RetrievalModel
from retrieval.training.prepare import prepare
from serving.app.config import RouterConfig, ServeConfig
from serving.app.server import Server
from serving.protos import admin_pb2 as pb
from serving.protos.admin_pb2_grpc import AdminStub
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


def start_router(root: Path, addresses: list[str], state: Path | None = None) -> Server:
    cfg = RouterConfig(shards=[[a] for a in addresses], shard_deadline_ms=10_000.0)
    server = Server(
        ServeConfig(
            model_repo=root, model="demo", grpc_port=0, poll_s=0, router=cfg, state_dir=state
        )
    )
    server.start()
    return server


@pytest.fixture(scope="module")
def router(creators, tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    repo = ModelRepository(root)
    repo.publish("demo", creators.model, shards=2)
    shards = [ShardServer(repo, "demo", s, poll_s=0) for s in range(2)]
    server = start_router(root, [s.start() for s in shards])
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


def test_new_creators_through_the_router_answer_as_the_unsharded_model(creators, tmp_path):
    """Two upserts through the router's Admin API, each naming a new creator, their items on
    different shards (the second batch's on shard 0, which has not seen the first's creator):
    filters naming them answer as the unsharded model given the same updates."""
    root = tmp_path / "repo"
    ModelRepository(root).publish("demo", creators.model, shards=2)
    shards = [ShardServer(ModelRepository(root), "demo", s, poll_s=0) for s in range(2)]
    router = start_router(root, [s.start() for s in shards], tmp_path / "state")
    try:
        spare = torch.arange(100, 140)
        owner = shard_of(spare, 2)
        ids = [int(spare[owner == 1][0]), int(spare[owner == 0][0])]
        dim = creators.model.index.dim
        vec = torch.randn(2, dim, generator=torch.Generator().manual_seed(3))
        assert router.addresses is not None
        admin = AdminStub(grpc.insecure_channel(router.addresses.grpc))
        model = copy.deepcopy(creators.model)
        for i, (id_, name) in enumerate(zip(ids, ["new-a", "new-b"], strict=True)):
            attrs = [pb.Attribute(name="creator", values=[name])]
            admin.UpsertItems(
                pb.UpsertItemsRequest(
                    items=[pb.Item(id=id_, vector=vec[i].tolist(), attributes=attrs)]
                ),
                timeout=30,
            )
            model = apply_update(
                model, UpsertItems(torch.tensor([id_]), [{"creator": (name,)}], vec[i : i + 1])
            )
        users, k = np.arange(4), 10
        assert router.state is not None
        for text in ["creator = new-b", "creator in {new-a, k7}", "creator != new-a"]:
            want_ids, want_scores = creators.expected(model, users, k, [text] * len(users))
            for row, u in enumerate(users):
                res = router.state.submit(creators.request(int(u), k, filter=text)).result(30)
                assert not res.partial
                assert_same_topk(
                    torch.from_numpy(res.item_ids[None]),
                    torch.from_numpy(res.scores[None]),
                    torch.from_numpy(want_ids[row : row + 1]),
                    torch.from_numpy(want_scores[row : row + 1]),
                )
        got = router.state.submit(creators.request(0, k, filter="creator = new-b")).result(30)
        assert got.item_ids[0] == ids[1]
    finally:
        router.drain_and_stop(timeout=5)
        for s in shards:
            s.stop(0)
