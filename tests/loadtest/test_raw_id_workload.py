"""The load generator against a model with id maps: the shape reads the raw item ids from the
published version, and its gRPC and KServe requests name the history in them; a real server
(in this process) answers them as the dense requests they stand for."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np

from loadtest.shape import read_model_shape
from loadtest.workload import RequestMix, kserve_body, recommend_request
from serving.app.config import ServeConfig
from serving.app.server import Server
from serving.frontends import kserve
from serving.frontends.kserve import WireTensor
from serving.frontends.recommend_grpc import parse_recommend
from serving.repository.repository import ModelRepository
from support.raw_id_model import raw_item, with_id_maps


def test_requests_name_the_history_in_raw_ids(tiny, tmp_path):
    ModelRepository(tmp_path).publish("demo", with_id_maps(tiny.model))
    plain = tmp_path / "plain"
    ModelRepository(plain).publish("demo", tiny.model)
    assert read_model_shape(plain).raw_item_ids is None
    shape = read_model_shape(tmp_path)
    assert shape.raw_item_ids == tuple(raw_item(i) for i in range(shape.num_items))
    mix = RequestMix(shape, pool=50, seed=1)
    rng = random.Random(0)
    reqs = [mix.draw(rng) for _ in range(20)]
    for r in reqs:
        assert r.raw_history == [raw_item(i) for i in r.history]
        msg = recommend_request(r, "demo")
        assert list(msg.raw_history) == r.raw_history and not msg.history
        names = [t["name"] for t in kserve_body(r)["inputs"]]
        assert "raw_history" in names and "history" not in names
    server = Server(ServeConfig(model_repo=tmp_path, grpc_port=0, poll_s=0))
    server.start()
    try:
        state = server.state
        assert state is not None
        spec = kserve.model_spec(state)
        for r in reqs[:5]:
            dense = state.recommend(
                parse_recommend(recommend_request(replace(r, raw_history=None)), None)
            )
            got = state.recommend(parse_recommend(recommend_request(r, "demo"), None))
            tensors = [
                WireTensor(t["name"], t["datatype"], t["shape"], values=t["data"])
                for t in kserve_body(r)["inputs"]
            ]
            (row,) = kserve.parse(tensors, spec)
            for answer in (got, state.recommend(row)):
                np.testing.assert_array_equal(answer.item_ids, dense.item_ids)
    finally:
        server.drain_and_stop(timeout=5)
