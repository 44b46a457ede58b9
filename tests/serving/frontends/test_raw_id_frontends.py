"""A model with id maps served in-process (a real server on 127.0.0.1 over the stand-in
repository): Recommend, KServe v2 gRPC (``tritonclient.grpc``) and HTTP (``tritonclient.http``)
take the history in the user's raw item ids and answer the raw ids of the recommended items,
equal to ``id_maps.items.to_raw(dense answer)``; an unknown raw id is refused naming it."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from retrieval.model import RetrievalModel
from serving.app.config import BatchingConfig
from serving.app.server import Server
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.types import DATATYPES
from support.raw_id_model import raw_item, with_id_maps
from support.tiny_model import StandInRepo, Tiny

WAIT = 10.0
USERS = [0, 3, 7, 42]


@pytest.fixture(params=["text", "int"])
def mapped(request: pytest.FixtureRequest, tiny: Tiny) -> RetrievalModel:
    return with_id_maps(tiny.model, int_ids=request.param == "int")


@pytest.fixture
def server(serve_config, mapped: RetrievalModel) -> Iterator[Server]:
    repo = StandInRepo()
    repo.publish(mapped)
    config = serve_config(
        http_port=0,
        metrics_port=None,
        batching=BatchingConfig(max_batch_size=8, max_queue_delay_ms=1.0, max_queue_size=8),
    )
    s = Server(config, repo=repo)  # plugins discovered: KServe gRPC joins
    s.start()
    yield s
    s.drain_and_stop(timeout=WAIT)


def is_int(mapped: RetrievalModel) -> bool:
    return mapped.id_maps is not None and mapped.id_maps.items.is_int


def raw_histories(tiny: Tiny, mapped: RetrievalModel, users: list[int]) -> np.ndarray:
    """The users' histories in raw ids ``[B, H]`` text, ``""`` pads (the dense ``-1`` ones)."""
    hist = tiny.prep.history[np.array(users)]  # [B, H] dense, -1 pads
    return np.array(
        [[raw_item(int(i), is_int(mapped)) if i >= 0 else "" for i in row] for row in hist]
    )


def expected(tiny: Tiny, mapped: RetrievalModel, users: list[int], k: int):
    """(dense ids [B, K], their raw ids as text [B, K], "" pads) of an in-process forward."""
    ids, _ = tiny.expected(mapped, np.array(users), k)
    assert mapped.id_maps is not None
    raw = mapped.id_maps.items.to_raw(ids).cast("string").fill_null("").to_pylist()
    return ids, np.array(raw, dtype=object).reshape(ids.shape)


def test_recommend_takes_and_answers_raw_ids(server, tiny, mapped):
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        stub = RecommenderStub(channel)
        for user in USERS:
            msg = tiny.message(user, k=12)
            del msg.history[:]
            msg.raw_history[:] = [r for r in raw_histories(tiny, mapped, [user])[0] if r]
            reply = stub.Recommend(msg, timeout=WAIT)
            ids, raw = expected(tiny, mapped, [user], 12)
            assert list(reply.item_ids) == ids[0].tolist()
            assert list(reply.raw_item_ids) == raw[0].tolist()
        # a dense history still works and still answers raw ids
        reply = stub.Recommend(tiny.message(3, k=5), timeout=WAIT)
        assert list(reply.raw_item_ids) == expected(tiny, mapped, [3], 5)[1][0].tolist()
        for bad, field, named in (
            (["sku-999999", "12x"], "raw_history", "'sku-999999' (position 0)"),
            (["", "nope"], "raw_history", "'nope' (position 1)"),
        ):
            msg = tiny.message(0)
            del msg.history[:]
            msg.raw_history[:] = bad
            with pytest.raises(grpc.RpcError) as err:
                stub.Recommend(msg, timeout=WAIT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{field}: item id {named}")
        msg = tiny.message(0)
        msg.raw_history[:] = [raw_item(0, is_int(mapped))]
        with pytest.raises(grpc.RpcError, match="give history or raw_history, not both"):
            stub.Recommend(msg, timeout=WAIT)


def kserve_inputs(
    tiny: Tiny, mapped: RetrievalModel, users: list[int], k: int, mod, raw: list | None = None
) -> list:
    """The KServe inputs of ``users`` with ``raw_history`` (``raw``: that one instead)."""
    arrays = tiny.inputs(np.array(users), k)
    hist = raw_histories(tiny, mapped, users) if raw is None else np.array(raw)
    arrays["raw_history"] = hist.astype(object)
    del arrays["history"]
    out = []
    for name, a in arrays.items():
        t = mod.InferInput(name, list(a.shape), DATATYPES[name])
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def test_kserve_grpc_takes_and_answers_raw_ids(server, tiny, mapped):
    client = tg.InferenceServerClient(server.addresses.grpc)
    try:
        meta = client.get_model_metadata("demo")
        inputs = {t.name: t.datatype for t in meta.inputs}
        assert inputs["raw_history"] == "BYTES" and "history" in inputs
        assert {t.name: t.datatype for t in meta.outputs}["raw_item_ids"] == "BYTES"
        config = client.get_model_config("demo").config
        assert [t.optional for t in config.input if t.name in ("history", "raw_history")] == [
            True,
            True,
        ]
        assert "raw_item_ids" in [t.name for t in config.output]
        result = client.infer("demo", kserve_inputs(tiny, mapped, USERS, 12, tg))
        ids, raw = expected(tiny, mapped, USERS, 12)
        np.testing.assert_array_equal(result.as_numpy("item_ids"), ids)
        got = np.vectorize(bytes.decode, otypes=[object])(result.as_numpy("raw_item_ids"))
        np.testing.assert_array_equal(got, raw)
        bad = kserve_inputs(
            tiny, mapped, USERS[:1], 5, tg, [[raw_item(4, is_int(mapped)), "sku-nope"]]
        )
        with pytest.raises(InferenceServerException) as err:
            client.infer("demo", bad)
        assert "StatusCode.INVALID_ARGUMENT" in str(err.value.status())
        assert "raw_history: item id 'sku-nope' (position 1)" in err.value.message()
    finally:
        client.close()


def test_kserve_http_takes_and_answers_raw_ids(server, tiny, mapped):
    client = th.InferenceServerClient(server.addresses.http, network_timeout=WAIT)
    try:
        meta = client.get_model_metadata("demo")
        assert {t["name"]: t["datatype"] for t in meta["outputs"]}["raw_item_ids"] == "BYTES"
        _, raw = expected(tiny, mapped, USERS, 12)
        for binary in (True, False):
            ask = [th.InferRequestedOutput("raw_item_ids", binary_data=binary)]
            inputs = kserve_inputs(tiny, mapped, USERS, 12, th)
            result = client.infer("demo", inputs, outputs=ask)
            assert result.as_numpy("item_ids") is None
            got = result.as_numpy("raw_item_ids")
            got = np.vectorize(
                lambda v: v.decode() if isinstance(v, bytes) else v, otypes=[object]
            )(got)
            np.testing.assert_array_equal(got, raw)
        bad = kserve_inputs(tiny, mapped, USERS[:1], 5, th, [["", "sku-nope"]])
        with pytest.raises(InferenceServerException, match=r"raw_history: item id 'sku-nope'"):
            client.infer("demo", bad)
    finally:
        client.close()


def test_raw_ids_are_refused_by_a_model_without_id_maps(serve_config, repo):
    server = Server(serve_config(http_port=0, metrics_port=None), repo=repo)
    server.start()
    try:
        client = th.InferenceServerClient(server.addresses.http, network_timeout=WAIT)
        names = [t["name"] for t in client.get_model_metadata("demo")["inputs"]]
        assert "raw_history" not in names
        t = th.InferInput("raw_history", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([["sku-1"]], dtype=object))
        with pytest.raises(InferenceServerException, match=r"raw_history: demo version 1 has no"):
            client.infer("demo", [t])
        client.close()
    finally:
        server.drain_and_stop(timeout=WAIT)
