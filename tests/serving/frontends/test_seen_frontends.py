"""Seen lists through every front end, in-process (a real server on 127.0.0.1 over the stand-in
repository): Recommend ``seen`` / ``raw_seen``, KServe v2 ``seen`` / ``raw_seen`` over
``tritonclient.grpc`` and ``tritonclient.http``. The seen items never come back, K others do, and
each answer equals the in-process ``model(batch with seen, k)``; bad lists are refused naming the
field.

The index skips each row's seen items inside its scan and probes for that row's list alone, so a
mixed batch must equal each request answered alone; the server's model probes every inverted
list (:func:`exhaustive`) so that this holds whatever the tuning.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from retrieval.model import RetrievalModel
from retrieval.seen import pad_lists
from serving.app.config import BatchingConfig
from serving.app.server import Server
from serving.limits import LimitsConfig
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.types import DATATYPES
from support.raw_id_model import raw_item, with_id_maps
from support.tiny_model import StandInRepo, Tiny
from support.topk_check import assert_same_topk

WAIT = 10.0
USERS = [0, 3, 7, 42]
MAX_SEEN = 64


@pytest.fixture(scope="module")
def exhaustive(tiny: Tiny) -> RetrievalModel:
    """The tiny model probing all of its lists (a copy: the session's model stays as it is)."""
    m = copy.deepcopy(tiny.model)
    m.index.config.nprobe = m.index.nlist
    return m.eval()


def serve(serve_config, model: RetrievalModel) -> Server:
    repo = StandInRepo()
    repo.publish(model)
    config = serve_config(
        http_port=0,
        metrics_port=None,
        limits=LimitsConfig(max_seen=MAX_SEEN),
        batching=BatchingConfig(max_batch_size=8, max_queue_delay_ms=2.0, max_queue_size=64),
    )
    s = Server(config, repo=repo)  # plugins discovered: KServe gRPC joins
    s.start()
    return s


@pytest.fixture
def server(serve_config, exhaustive) -> Iterator[Server]:
    s = serve(serve_config, exhaustive)
    yield s
    s.drain_and_stop(timeout=WAIT)


def seen_of(tiny: Tiny, model: RetrievalModel, user: int, length: int) -> np.ndarray:
    """``int64 [length]``: every other one of the user's top 2 * length items without a seen
    list (so the exclusion changes the answer), then random others, shuffled."""
    top, _ = tiny.expected(model, np.array([user]), 2 * length)
    rng = np.random.default_rng(user)
    ids = list(dict.fromkeys(top[0, ::2].tolist()))[: length // 2]
    ids += rng.choice(model.config.num_items, length - len(ids), replace=False).tolist()
    return rng.permutation(np.array(ids[:length], dtype=np.int64))


def alone(tiny: Tiny, model: RetrievalModel, user: int, seen: np.ndarray | None, k: int):
    """The in-process answer of one request with its seen list: ``(ids [1, K], scores [1, K])``."""
    batch = tiny.prep.user_batch(np.array([user]))
    batch.seen = pad_lists([seen])
    with torch.inference_mode():
        return model(batch, k)


def check_row(ids, scores, want: tuple[torch.Tensor, torch.Tensor], seen) -> None:
    ids_t, scores_t = torch.tensor(np.asarray(ids))[None], torch.tensor(np.asarray(scores))[None]
    assert_same_topk(ids_t, scores_t.float(), *want)
    assert (ids_t >= 0).all(), "K items come back"
    if seen is not None:
        assert not set(ids_t[0].tolist()) & set(np.asarray(seen).tolist())


def test_recommend_removes_the_seen_items_and_returns_k_others(server, tiny, exhaustive):
    k = 12
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        stub = RecommenderStub(channel)
        for user in USERS:
            seen = seen_of(tiny, exhaustive, user, 20)
            reply = stub.Recommend(tiny.message(user, k=k, seen=seen.tolist()), timeout=WAIT)
            want = alone(tiny, exhaustive, user, seen, k)
            check_row(reply.item_ids, reply.scores, want, seen)
            # = the answer without a seen list, seen items struck out, topped up from below
            ids, _ = tiny.expected(exhaustive, np.array([user]), k + len(seen))
            assert list(reply.item_ids) == [i for i in ids[0] if i not in set(seen)][:k]
            assert list(reply.item_ids) != ids[0, :k].tolist()


def test_concurrent_requests_with_and_without_seen_lists_equal_each_alone(server, tiny, exhaustive):
    users = list(range(16))
    seens = [seen_of(tiny, exhaustive, u, 3 * u) if u % 3 else None for u in users]

    def call(u: int) -> tuple[list[int], list[float]]:
        with grpc.insecure_channel(server.addresses.grpc) as channel:
            mine = seens[u]
            seen = [] if mine is None else mine.tolist()
            r = RecommenderStub(channel).Recommend(tiny.message(u, k=8, seen=seen), timeout=WAIT)
            return list(r.item_ids), list(r.scores)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(call, users))
    for u, (ids, scores) in zip(users, replies, strict=True):
        check_row(ids, scores, alone(tiny, exhaustive, u, seens[u], 8), seens[u])


def kserve_inputs(tiny: Tiny, users: list[int], k: int, mod, json: bool = False, **extra) -> list:
    """``users``' KServe inputs (``extra``: more tensors by name), for ``tritonclient.<mod>``;
    ``json``: HTTP typed contents instead of binary ones."""
    arrays = {**tiny.inputs(np.array(users), k), **extra}
    out = []
    for name, a in arrays.items():
        t = mod.InferInput(name, list(a.shape), DATATYPES[name])
        t.set_data_from_numpy(a, **({"binary_data": False} if json else {}))
        out.append(t)
    return out


def padded(seens: list[np.ndarray | None]) -> np.ndarray:
    rows = pad_lists(seens)
    assert rows is not None
    return rows.numpy()


@pytest.mark.parametrize("protocol", ["grpc", "http-binary", "http-json"])
def test_kserve_mixed_batch_equals_each_request_alone(server, tiny, exhaustive, protocol):
    lengths = [0, 5, 30, 11]  # row 0 has no seen list: all pads
    seens = [
        seen_of(tiny, exhaustive, u, n) if n else None for u, n in zip(USERS, lengths, strict=True)
    ]
    if protocol == "grpc":
        client: Any = tg.InferenceServerClient(server.addresses.grpc)
        inputs = kserve_inputs(tiny, USERS, 10, tg, seen=padded(seens))
        metadata = client.get_model_metadata("demo").inputs
        meta = {t.name: (t.datatype, list(t.shape)) for t in metadata}
        declared = {t.name: t.optional for t in client.get_model_config("demo").config.input}
    else:
        client = th.InferenceServerClient(server.addresses.http, network_timeout=WAIT)
        json = protocol == "http-json"
        inputs = kserve_inputs(tiny, USERS, 10, th, json, seen=padded(seens))
        meta = {
            t["name"]: (t["datatype"], t["shape"])
            for t in client.get_model_metadata("demo")["inputs"]
        }
        config = client.get_model_config("demo")["input"]
        declared = {t["name"]: t.get("optional", False) for t in config}
    try:
        assert meta["seen"] == ("INT64", [-1, -1]) and declared["seen"] is True
        result = client.infer("demo", inputs)
        ids, scores = result.as_numpy("item_ids"), result.as_numpy("scores")
        for row, (u, seen) in enumerate(zip(USERS, seens, strict=True)):
            check_row(ids[row], scores[row], alone(tiny, exhaustive, u, seen, 10), seen)
    finally:
        client.close()


# ---- refusals ---------------------------------------------------------------------------------
N = 300  # the tiny catalog


@pytest.mark.parametrize(
    ("seen", "message"),
    [
        ([4, -2], f"seen: item id -2 is not in [0, {N})"),
        ([N], f"seen: item id {N} is not in [0, {N})"),
        (
            list(range(MAX_SEEN + 1)),
            f"seen: {MAX_SEEN + 1} item ids is over the limit of {MAX_SEEN} (limits.max_seen)",
        ),
    ],
)
def test_recommend_refuses_a_bad_seen_list_naming_it(server, tiny, seen, message):
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        stub = RecommenderStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Recommend(tiny.message(0, seen=seen), timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == message
        with pytest.raises(grpc.RpcError) as err:  # a model without id maps takes no raw_seen
            stub.Recommend(tiny.message(0, raw_seen=["sku-001"]), timeout=WAIT)
        assert err.value.details().startswith("raw_seen: demo version 1 has no id maps")
        assert stub.Recommend(tiny.message(0, seen=[-1, 5]), timeout=WAIT).item_ids  # -1 pads


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize(
    ("row1", "message"),
    [
        ([7, -5], "seen: item id -5 is not in [0, 300) (batch row 1)"),
        ([N + 1, 2], "seen: item id 301 is not in [0, 300) (batch row 1)"),
        ([1] * (MAX_SEEN + 1), "seen: 65 item ids is over the limit of 64 (limits.max_seen)"),
    ],
)
def test_kserve_refuses_a_bad_seen_row_naming_it(server, tiny, protocol, row1, message):
    seen = np.full((2, len(row1)), -1, dtype=np.int64)
    seen[1] = row1
    if protocol == "grpc":
        client: Any = tg.InferenceServerClient(server.addresses.grpc)
        code = "StatusCode.INVALID_ARGUMENT"
    else:
        client, code = th.InferenceServerClient(server.addresses.http, network_timeout=WAIT), "400"
    try:
        mod = tg if protocol == "grpc" else th
        with pytest.raises(InferenceServerException) as err:
            client.infer("demo", kserve_inputs(tiny, [1, 2], 5, mod, seen=seen))
        assert err.value.status() == code and err.value.message() == message
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_kserve_raw_seen_on_a_model_without_id_maps_says_to_send_seen(server, tiny, protocol):
    mod: Any = tg if protocol == "grpc" else th
    address = server.addresses.grpc if protocol == "grpc" else server.addresses.http
    client = mod.InferenceServerClient(address)
    try:
        raw_seen = np.array([[b"sku-001"]], dtype=object)
        with pytest.raises(InferenceServerException) as err:
            client.infer("demo", kserve_inputs(tiny, [1], 5, mod, raw_seen=raw_seen))
        assert err.value.message().startswith("raw_seen: demo version 1 has no id maps")
        assert err.value.message().endswith("send seen, the dense item ids")
    finally:
        client.close()


# ---- raw ids ----------------------------------------------------------------------------------
@pytest.fixture
def mapped_server(serve_config, exhaustive) -> Iterator[tuple[Server, RetrievalModel]]:
    mapped = with_id_maps(exhaustive)
    s = serve(serve_config, mapped)
    yield s, mapped
    s.drain_and_stop(timeout=WAIT)


def test_raw_seen_on_a_model_with_id_maps(mapped_server, tiny):
    server, mapped = mapped_server
    seens = [seen_of(tiny, mapped, u, 16) for u in USERS]
    raw = [[raw_item(int(i)) for i in s] for s in seens]
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        stub = RecommenderStub(channel)
        for user, seen, text in zip(USERS, seens, raw, strict=True):
            reply = stub.Recommend(tiny.message(user, k=9, raw_seen=text), timeout=WAIT)
            check_row(reply.item_ids, reply.scores, alone(tiny, mapped, user, seen, 9), seen)
            assert set(reply.raw_item_ids).isdisjoint(text)
        msg = tiny.message(0, raw_seen=["", raw_item(3), "sku-nope"])
        with pytest.raises(grpc.RpcError) as err:
            stub.Recommend(msg, timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("raw_seen: item id 'sku-nope' (position 2)")
        with pytest.raises(grpc.RpcError, match="give seen or raw_seen, not both"):
            stub.Recommend(tiny.message(0, seen=[3], raw_seen=[raw_item(3)]), timeout=WAIT)
    table = np.full((len(USERS), 16), "", dtype=object)  # [B, S] text, "" pads
    table[1:] = np.array(raw[1:], dtype=object)  # row 0: no seen list
    client = tg.InferenceServerClient(server.addresses.grpc)
    try:
        names = [t.name for t in client.get_model_config("demo").config.input]
        assert "raw_seen" in names and "seen" in names
        result = client.infer("demo", kserve_inputs(tiny, USERS, 9, tg, raw_seen=table))
        ids, scores = result.as_numpy("item_ids"), result.as_numpy("scores")
        wanted: list[np.ndarray | None] = [None, *seens[1:]]
        for row, (u, row_seen) in enumerate(zip(USERS, wanted, strict=True)):
            check_row(ids[row], scores[row], alone(tiny, mapped, u, row_seen, 9), row_seen)
    finally:
        client.close()
