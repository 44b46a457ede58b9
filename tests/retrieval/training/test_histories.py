"""Training pairs' histories: causal (items before the pair) and static (positive hidden)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.data import Interactions
from retrieval.training.histories import causal_history, static_history, timeline_first
from retrieval.training.prepare import prepare
from support.split_data import tiny


def test_the_docstring_example() -> None:
    items = np.array([5, 7, 9, 2, 4])
    first = timeline_first(np.array([0, 0, 0, 1, 1]))
    assert first.tolist() == [0, 0, 0, 3, 3]
    out = causal_history(items, first, np.array([2, 4]), 3)
    assert out.tolist() == [[7, 5, -1], [2, -1, -1]]


def test_a_split_timeline_is_refused() -> None:
    with pytest.raises(ValueError, match="timeline order"):
        timeline_first(np.array([0, 1, 0]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=6), st.integers(1, 4))
def test_causal_history_is_the_items_before_the_pair(counts: list[int], h: int) -> None:
    users = np.repeat(np.arange(len(counts)), counts)
    items = np.arange(len(users)) * 10
    first = timeline_first(users)
    out = causal_history(items, first, np.arange(len(users)), h)
    for j, u in enumerate(users):
        before = [int(items[i]) for i in range(j - 1, -1, -1) if users[i] == u][:h]
        assert out[j].tolist() == before + [-1] * (h - len(before))


def test_static_history_hides_the_positive() -> None:
    hist = np.array([[3, 4, -1], [5, 6, 7]])
    out = static_history(hist, np.array([0, 1]), np.array([4, 9]))
    assert out.tolist() == [[3, -1, -1], [5, 6, 7]]


def test_prepare_keeps_the_pairs_in_timeline_order() -> None:
    ds = tiny()
    prep = prepare(ds, history_len=4)
    tr = prep.train
    assert tr.pair_first is not None
    # each pair's causal history is its user's earlier training items, newest first
    ts = {}
    it: Interactions = ds.interactions
    for u, i, t in zip(it.user_id, it.item_id, it.timestamp, strict=True):
        ts[(int(u), int(i))] = int(t)
    hist = causal_history(tr.item_ids, tr.pair_first, np.arange(len(tr.item_ids)), 4)
    for j in range(len(tr.item_ids)):
        u, i = int(tr.user_ids[j]), int(tr.item_ids[j])
        earlier = [x for x in hist[j] if x >= 0]
        assert all(ts[(u, int(x))] <= ts[(u, i)] for x in earlier)
