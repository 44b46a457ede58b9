"""The front end <-> engine messages (``serving/engine/wire.py``): rows, results, errors and the
model's description come back as they went, arrays as views of the frames (no pickle)."""

from __future__ import annotations

from concurrent.futures import CancelledError

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine import wire
from serving.engine.batching import BatchPolicy
from serving.engine.client import ModelInfo
from serving.types import (
    DeadlineExceededError,
    ModelNotFoundError,
    QueueFullError,
    RecRequest,
    RecResult,
    RequestError,
    UnavailableError,
)

ids = st.lists(st.integers(-1, 2**40), max_size=6).map(lambda v: np.array(v, dtype=np.int64))
texts = st.lists(st.text(max_size=5), max_size=4).map(lambda v: np.array(v, dtype=object))


@st.composite
def requests(draw: st.DrawFn) -> RecRequest:
    return RecRequest(
        history=draw(ids),
        categorical=draw(ids),
        dense=np.array(draw(st.lists(st.floats(width=32), max_size=4)), dtype=np.float32),
        k=draw(st.integers(1, 100)),
        filter=draw(st.none() | st.text(max_size=10)),
        user_id=draw(st.text(max_size=5)),
        deadline=draw(st.none() | st.floats(0, 1e6)),
        version=draw(st.none() | st.integers(1, 10)),
        seen=draw(st.none() | ids),
        raw_history=draw(st.none() | texts),
        raw_seen=draw(st.none() | texts),
        recall_target=draw(st.floats(0, 1)),
        user=draw(st.integers(-1, 50)),
    )


def _same(a: RecRequest, b: RecRequest) -> None:
    for name in ("history", "categorical", "dense", "seen", "raw_history", "raw_seen"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None and x.dtype == object:
            assert x.tolist() == y.tolist(), name
        elif x is not None:  # the bytes: a NaN crosses as the NaN it was
            assert (x.dtype, x.tobytes()) == (y.dtype, y.tobytes()), name
    for name in ("k", "filter", "user_id", "deadline", "model", "version", "recall_target", "user"):
        assert getattr(a, name) == getattr(b, name), name


@settings(max_examples=60, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=4))
def test_rows_round_trip(reqs: list[RecRequest]) -> None:
    frames = wire.encode_requests({"fe": "f", "id": 3}, reqs)
    assert all(isinstance(f, bytes | np.ndarray) for f in frames)
    head = wire.header(frames)
    assert (head["t"], head["id"]) == ("sub", 3)
    back = wire.decode_requests(head, [bytes(memoryview(f)) for f in frames])
    assert len(back) == len(reqs)
    for a, b in zip(reqs, back, strict=True):
        _same(a, b)


def test_results_and_row_errors_round_trip() -> None:
    ok = RecResult(np.array([4, 2, -1]), np.array([0.5, 0.25, -np.inf], np.float32), "demo", 3,
                   partial=True, missing=["shard 1"])  # fmt: skip
    outcomes = [ok, RequestError("k: bad"), ok]
    frames = wire.encode_results({"id": 9}, outcomes)
    back = wire.decode_results(wire.header(frames), frames)
    assert isinstance(back[1], RequestError) and str(back[1]) == "k: bad"
    for r in (back[0], back[2]):
        assert isinstance(r, RecResult)
        assert r.item_ids.tolist() == [4, 2, -1] and r.scores.tolist() == ok.scores.tolist()
        assert (r.model, r.version, r.partial, r.missing) == ("demo", 3, True, ["shard 1"])
        assert r.raw_item_ids is None


@pytest.mark.parametrize(
    "exc",
    [
        RequestError("a"),
        ModelNotFoundError("b"),
        QueueFullError("c"),
        DeadlineExceededError("d"),
        UnavailableError("e"),
        CancelledError("f"),
    ],
)
def test_serving_errors_cross_as_themselves(exc: BaseException) -> None:
    back = wire.exception_of(wire.error_of(exc))
    assert type(back) is type(exc) and str(back) == str(exc)


def test_other_errors_cross_as_internal_with_their_message() -> None:
    back = wire.exception_of(wire.error_of(KeyError("x")))
    assert type(back) is RuntimeError and "KeyError" in str(back)


def test_the_model_description_round_trips() -> None:
    info = ModelInfo("demo", 2, 3, 4, 50, True, False, "pytorch", BatchPolicy(16, 0.002, 64, (8,)))
    fields, config = wire.encode_info(info)
    assert wire.decode_info(fields, config) == info
    assert wire.encode_info(None) == (None, b"") and wire.decode_info(None, b"") is None
