"""Fuzzing ``Recommend`` on one real gRPC server (the tiny model on 127.0.0.1).

Random field values (K, ids, lengths, NaN / infinity, filter text, model, version) and random
bytes: every answer is OK (and a valid one) or INVALID_ARGUMENT / NOT_FOUND whose message starts
with the field it is about; never INTERNAL or UNKNOWN. An independent oracle says which fields of
a message are bad, so an OK answer to a bad request (or a refusal of a good one) fails too.
A canary thread sends valid requests during the whole run and every one is answered; after the
run the server still answers with the model's own top-K. A message over the receive limit is
RESOURCE_EXHAUSTED.
Bytes that are no ``RecommendRequest`` at all get INVALID_ARGUMENT (the service is registered
with ``common.grpc_util.add_service``; gRPC's generated one answers INTERNAL).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from retrieval.filters import parse_filter
from serving.app.server import Server
from serving.protos import recommend_pb2 as pb
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.types import MAX_K
from support.fuzz_util import WAIT, Canary, Quiet, fuzz_settings, serving
from support.tiny_model import Tiny

RECEIVE_LIMIT = 64 << 10
"""The server's ``max_receive_message_bytes`` (small, so a message over it is cheap to send)."""
METHOD = "/recserve.serving.v1.Recommender/Recommend"
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
FUZZ = fuzz_settings(300)


@pytest.fixture(scope="module")
def tiny(tiny: Tiny) -> Tiny:
    """The session's tiny model (``tests/support/serving_fixtures.py``), quiet."""
    return Quiet(tiny)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("fuzz_recommend")
    with serving(tiny, root, max_receive_message_bytes=RECEIVE_LIMIT) as s:
        yield s


@pytest.fixture(scope="module")
def channel(server: Server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.addresses.grpc) as ch:
        yield ch


@pytest.fixture(scope="module")
def canary(server: Server, channel: grpc.Channel, tiny) -> Iterator[Canary]:
    """Sends a valid request (with a filter) every 20 ms during the whole module."""
    msg, stub = tiny.message(5, k=10, filter="available"), RecommenderStub(channel)

    def call(n: int) -> None:
        assert len(stub.Recommend(msg, timeout=WAIT).item_ids) == 10

    c = Canary(call)
    c.start()
    yield c
    c.stop()


# ---- the oracle ----------------------------------------------------------------------------------
def bad_fields(tiny, msg: pb.RecommendRequest) -> set[str]:
    """The fields of ``msg`` the server must refuse (empty: it must answer)."""
    cfg = tiny.prep.config
    num_items = cfg.num_items
    ntotal = tiny.model.index.ntotal
    bad = set()
    if msg.model not in ("", "demo"):
        bad.add("model")
    if msg.version < 0 or msg.version not in (0, 1):
        bad.add("version")
    if any(not -1 <= i < num_items for i in msg.history):
        bad.add("history")
    cards = list(cfg.user_features.values())
    if len(msg.categorical) != len(cards) or any(
        not -1 <= c < n for c, n in zip(msg.categorical, cards, strict=True)
    ):
        bad.add("categorical")
    if len(msg.dense) != cfg.dense_dim or not np.isfinite(list(msg.dense)).all():
        bad.add("dense")
    if not 1 <= msg.k <= min(MAX_K, num_items, ntotal):
        bad.add("k")
    if msg.filter:
        try:
            tiny.model.index.schema.check(parse_filter(msg.filter))
        except ValueError:
            bad.add("filter")
    return bad


def expect_answer(tiny, call, msg: pb.RecommendRequest, payload: object = None) -> None:
    """Sends ``payload`` (default: ``msg``) and checks the answer against the oracle."""
    bad = bad_fields(tiny, msg)
    try:
        reply = call(msg if payload is None else payload, timeout=WAIT)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        assert code in REFUSED, f"{code} {details!r} for {msg}"
        field = details.split(":", 1)[0]
        event(f"{code.name} {field}")
        assert field in bad, f"refused naming {field!r} ({details!r}); bad fields: {bad}"
        want = grpc.StatusCode.NOT_FOUND if field in ("model", "version") else None
        if want is not None and not (field == "version" and msg.version < 0):
            assert code == want, details
        return
    if isinstance(reply, bytes):
        reply = pb.RecommendResponse.FromString(reply)
    event("OK")
    assert not bad, f"answered a request with bad {bad}: {msg}"
    assert (reply.model, reply.version) == ("demo", 1)
    assert len(reply.item_ids) == len(reply.scores) == msg.k
    ids = np.array(reply.item_ids)
    assert ((ids >= -1) & (ids < tiny.prep.config.num_items)).all()


# ---- strategies ----------------------------------------------------------------------------------
ATTRIBUTES = ["category", "language", "region", "age_rating", "available", "colour", "", "not"]
VALUES = ["news", "en", "fr", "eu", "18+", "true", "false", "xx", "", "a b", "{", "'"]
ids = st.one_of(
    st.integers(-1, 299),
    st.sampled_from([-2, 300, 301, 2**31, 2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1),
)
floats = st.one_of(st.floats(-3, 3, width=32), st.floats(width=32))


@st.composite
def filter_texts(draw: st.DrawFn) -> str:
    """Mostly filter-shaped text (known and unknown attributes and values), sometimes junk."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.text(max_size=60))
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        attr = draw(st.sampled_from(ATTRIBUTES) | st.text("abcz_.", min_size=1, max_size=8))
        value = draw(st.sampled_from(VALUES))
        form = draw(st.integers(0, 4))
        clause = [
            attr,
            f"{attr} = {value}",
            f"{attr} != '{value}'",
            f'{attr} in {{"{value}", "{draw(st.sampled_from(VALUES))}"}}',
            f"{attr} not in {{{value}}}",
        ][form]
        parts.append(("not " if draw(st.booleans()) else "") + clause)
    joiner = draw(st.sampled_from([" and ", " AND ", " or ", ", ", " and and "]))
    return joiner.join(parts)


@st.composite
def changes(draw: st.DrawFn) -> dict[str, object]:
    """A random subset of the fields of a request, with random values (``user`` and ``k`` pick
    the valid request they replace fields of)."""
    out: dict[str, object] = {"user": draw(st.integers(0, 99)), "k": draw(st.integers(1, 50))}
    if draw(st.integers(0, 2)) == 0:
        out["k"] = draw(
            st.integers(-(2**31), 2**31 - 1) | st.sampled_from([0, -1, 300, 301, MAX_K])
        )
    if draw(st.integers(0, 2)) == 0:
        out["history"] = draw(st.lists(ids, max_size=40))
    if draw(st.integers(0, 2)) == 0:
        n = draw(st.sampled_from([0, 1, 2, 3, 3, 3, 4, 50]))
        out["categorical"] = draw(st.lists(st.integers(-2, 9) | ids, min_size=n, max_size=n))
    if draw(st.integers(0, 2)) == 0:
        n = draw(st.sampled_from([0, 2, 3, 3, 3, 4, 100]))
        out["dense"] = draw(st.lists(floats, min_size=n, max_size=n))
    if draw(st.integers(0, 2)) == 0:
        out["filter"] = draw(filter_texts())
    if draw(st.integers(0, 5)) == 0:
        out["model"] = draw(
            st.sampled_from(["demo", "other", "DEMO", " demo"]) | st.text(max_size=8)
        )
    if draw(st.integers(0, 5)) == 0:
        out["version"] = draw(st.sampled_from([0, 1, 2, -1]) | st.integers(-(2**63), 2**63 - 1))
    if draw(st.booleans()):
        out["user_id"] = draw(st.text(max_size=20))
    return out


def message(tiny, change: dict[str, object]) -> pb.RecommendRequest:
    """The valid request of ``change["user"]`` with the fields of ``change`` replaced."""
    fields = dict(change)
    msg = tiny.message(fields.pop("user"), k=fields.pop("k"))
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(msg, name)[:] = value
        else:
            setattr(msg, name, value)
    return msg


# ---- the tests -----------------------------------------------------------------------------------
@pytest.mark.slow
@FUZZ
@given(changes())
def test_random_field_values_get_ok_or_a_refusal_naming_the_field(channel, canary, tiny, change):
    msg = message(tiny, change)
    expect_answer(tiny, RecommenderStub(channel).Recommend, msg)


@st.composite
def appended(draw: st.DrawFn) -> pb.RecommendRequest:
    """One random field, to append to a message's bytes (the result still parses: repeated
    fields grow, a scalar is overwritten, the last one wins)."""
    extra = pb.RecommendRequest()
    which = draw(st.sampled_from(["history", "categorical", "dense", "k", "filter", "version"]))
    if which in ("history", "categorical"):
        getattr(extra, which).extend(draw(st.lists(ids, min_size=1, max_size=5)))
    elif which == "dense":
        extra.dense.extend(draw(st.lists(floats, min_size=1, max_size=5)))
    elif which == "k":
        extra.k = draw(st.integers(-(2**31), 2**31 - 1))
    elif which == "filter":
        extra.filter = draw(filter_texts())
    else:
        extra.version = draw(st.integers(-(2**63), 2**63 - 1))
    return extra


@pytest.mark.slow
@FUZZ
@given(changes(), appended())
def test_raw_bytes_that_parse_are_judged_like_the_message(channel, canary, tiny, change, extra):
    payload = message(tiny, change).SerializeToString() + extra.SerializeToString()
    msg = pb.RecommendRequest.FromString(payload)
    raw = channel.unary_unary(METHOD)  # no serializers: bytes in, bytes out
    expect_answer(tiny, raw, msg, payload)


def unparseable(tiny) -> list[bytes]:
    good = tiny.message(0, filter="language = en").SerializeToString()
    return [
        good[: len(good) // 2],  # cut inside a field
        good[:-1],
        b"\x08",  # k's tag, no value
        b"\xff\xff\xff",  # no valid tag
        b"\x32\x04\xff\xfe\xfd\xfc",  # filter: not UTF-8
        b"\x12\x80\x80\x80\x80\x10",  # history: a length past the end
    ]


@pytest.mark.parametrize("case", range(6))
def test_bytes_that_do_not_parse_are_invalid_argument(channel, canary, tiny, case):
    payload = unparseable(tiny)[case]
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(METHOD)(payload, timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("request: not a valid recserve.serving.v1.")


@settings(max_examples=60, deadline=None, database=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_get_unknown_or_hang(channel, canary, tiny, payload):
    """Any bytes: a known status within the deadline; bytes that do not parse get
    INVALID_ARGUMENT."""
    try:
        msg = pb.RecommendRequest.FromString(payload)
    except Exception:
        msg = None
    if msg is not None:
        expect_answer(tiny, channel.unary_unary(METHOD), msg, payload)
        return
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(METHOD)(payload, timeout=WAIT)
    event(f"does not parse: {err.value.code().name}")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def test_a_message_over_the_receive_limit_is_resource_exhausted(channel, canary, tiny):
    msg = tiny.message(0)
    msg.history[:] = [299] * RECEIVE_LIMIT  # 2 bytes a varint: twice the limit in all
    assert msg.ByteSize() > RECEIVE_LIMIT
    with pytest.raises(grpc.RpcError) as err:
        RecommenderStub(channel).Recommend(msg, timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_valid_requests_were_answered_during_and_after_the_fuzzing(channel, canary, tiny):
    """Runs last in this module (pytest keeps file order)."""
    assert canary.made(1) and not canary.failures, canary.failures[:5]
    reply = RecommenderStub(channel).Recommend(tiny.message(3, k=12), timeout=WAIT)
    with torch.inference_mode():
        ids, scores = tiny.model(tiny.prep.user_batch(np.array([3])), 12)
    assert list(reply.item_ids) == ids[0].tolist()
    np.testing.assert_allclose(reply.scores, scores[0].numpy(), rtol=1e-6)
