"""serving.raw_ids: the user's raw item ids <-> the model's dense ids at the edge, for string and
integer maps; unknown ids refused naming raw_history, the id and its position."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.data.id_map import IdMap
from serving.raw_ids import decode_text, dense_history, raw_item_ids
from serving.types import RequestError

TEXT = IdMap("item_id", pa.array(["sku-9", "sku-1", "a", "zz"]))
INTS = IdMap("item_id", pa.array([907, 12, -3], pa.int64()))


def test_text_ids_map_both_ways_with_pads():
    dense = dense_history(["zz", "", "sku-9", "a"], TEXT)
    assert dense.dtype == np.int64 and dense.tolist() == [3, -1, 0, 2]
    out = raw_item_ids(np.array([[1, 0, -1], [3, 2, 2]]), TEXT)
    assert out.tolist() == [["sku-1", "sku-9", ""], ["zz", "a", "a"]]
    assert dense_history([], TEXT).tolist() == []
    assert dense_history(["", ""], TEXT).tolist() == [-1, -1]


def test_integer_ids_travel_as_their_decimal_text():
    assert dense_history(["12", "-3", "", "907"], INTS).tolist() == [1, 2, -1, 0]
    assert raw_item_ids(np.array([[2, 0, -1]]), INTS).tolist() == [["-3", "907", ""]]


@pytest.mark.parametrize(
    ("items", "history", "message"),
    [
        (
            TEXT,
            ["a", "nope", "b"],
            r"^raw_history: item id 'nope' \(position 1\) is not one of "
            r"the model's 4 item ids \(2 ids of the history are unknown\)$",
        ),
        (TEXT, ["", "SKU-9"], r"^raw_history: item id 'SKU-9' \(position 1\) is not one of"),
        (INTS, ["12", "13"], r"^raw_history: item id '13' \(position 1\) is not one of"),
        (INTS, ["12", "", "x1"], r"^raw_history: item id 'x1' \(position 2\) is not an integer"),
        (INTS, ["1.5"], r"^raw_history: item id '1.5' \(position 0\) is not an integer"),
    ],
)
def test_unknown_ids_are_refused_naming_them(items, history, message):
    with pytest.raises(RequestError, match=message):
        dense_history(history, items)


def test_ids_beyond_the_map_and_a_version_without_maps_answer_empty_text():
    # an item a live update added past the trained catalog has no raw id
    assert raw_item_ids(np.array([[4, 1, 99]]), TEXT).tolist() == [["", "sku-1", ""]]
    assert raw_item_ids(np.array([[0, 1]]), None).tolist() == [["", ""]]


def test_bytes_decode_as_utf8_or_are_refused_naming_the_field():
    text = decode_text(np.array([[b"sku-9", "é".encode()], [b"", b"a"]], dtype=object))
    assert text.shape == (2, 2) and text.tolist() == [["sku-9", "é"], ["", "a"]]
    with pytest.raises(RequestError, match=r"^raw_history: an item id is not UTF-8"):
        decode_text(np.array([b"\xff"], dtype=object))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(min_size=1), min_size=1, max_size=30, unique=True), st.data())
def test_round_trip_equals_the_map(raw, data):
    items = IdMap("item_id", pa.array(raw, pa.string()))
    picks = data.draw(st.lists(st.integers(-1, len(raw) - 1), max_size=20))
    history = ["" if p < 0 else raw[p] for p in picks]
    dense = dense_history(history, items)
    assert dense.tolist() == picks
    back = raw_item_ids(dense.reshape(1, -1), items)[0].tolist()
    assert back == history
    expected = items.to_raw(np.array(picks, np.int64)).to_pylist()
    assert back == ["" if e is None else e for e in expected]
