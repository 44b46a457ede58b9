"""A document-sharded version of a model with id maps: the router part carries the maps, so the
router takes raw_history and answers raw_item_ids like a whole-model server (in this process,
real gRPC on loopback)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from serving.app.config import RouterConfig, ServeConfig
from serving.app.server import Server
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository.repository import ModelRepository
from serving.sharding.shard_server import ShardServer
from support.raw_id_model import raw_item, with_id_maps
from support.topk_check import assert_same_topk

WAIT = 10.0


def test_the_router_takes_and_answers_raw_ids(tiny, tmp_path):
    model = with_id_maps(tiny.model)
    repo = ModelRepository(tmp_path)
    repo.publish("demo", model, shards=2)
    shards = [ShardServer(repo, "demo", s, poll_s=0) for s in range(2)]
    addresses = [[s.start()] for s in shards]
    cfg = RouterConfig(shards=addresses, shard_deadline_ms=10_000.0)
    router = Server(
        ServeConfig(model_repo=tmp_path, model="demo", grpc_port=0, poll_s=0, router=cfg)
    )
    router.start()
    try:
        assert router.host.current().item_map is not None  # the router part holds the maps
        with grpc.insecure_channel(router.addresses.grpc) as channel:
            stub = RecommenderStub(channel)
            for user in (0, 3, 7):
                msg = tiny.message(user, k=10)
                dense = list(msg.history)
                del msg.history[:]
                msg.raw_history[:] = [raw_item(i) for i in dense]
                reply = stub.Recommend(msg, timeout=WAIT)
                assert not reply.partial
                ids, scores = tiny.expected(model, np.array([user]), 10)
                assert_same_topk(  # the routed answer is the whole model's (ties aside)
                    torch.tensor([list(reply.item_ids)]),
                    torch.tensor([list(reply.scores)]),
                    torch.from_numpy(ids),
                    torch.from_numpy(scores),
                )
                assert model.id_maps is not None
                want = model.id_maps.items.to_raw(np.array(reply.item_ids)).to_pylist()
                assert list(reply.raw_item_ids) == ["" if w is None else w for w in want]
            msg = tiny.message(0)
            del msg.history[:]
            msg.raw_history[:] = ["sku-nope"]
            with pytest.raises(grpc.RpcError) as err:
                stub.Recommend(msg, timeout=WAIT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("raw_history: item id 'sku-nope'")
    finally:
        router.drain_and_stop(timeout=5)
        for s in shards:
            s.stop(0)
