"""Time split and recent history: property tests against a plain per-user reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.data import Interactions, history_by_user, split_by_time

NUM_USERS = 7


@st.composite
def interactions(draw: st.DrawFn) -> Interactions:
    """Up to 80 events over 7 users with many timestamp ties."""
    m = draw(st.integers(0, 80))

    def column(hi: int) -> np.ndarray:
        return np.array(draw(st.lists(st.integers(0, hi), min_size=m, max_size=m)), np.int64)

    return Interactions(column(NUM_USERS - 1), column(30), column(15))


def rows(it: Interactions) -> list[tuple[int, int, int]]:
    return sorted(zip(it.user_id.tolist(), it.item_id.tolist(), it.timestamp.tolist(), strict=True))


@settings(max_examples=200, deadline=None)
@given(it=interactions(), frac=st.floats(0.0, 0.95), min_train=st.integers(0, 4))
def test_split_by_time_properties(it, frac, min_train):
    it.item_id = np.arange(len(it), dtype=np.int64)  # the split ignores items: tag rows instead
    train, test = split_by_time(it, test_fraction=frac, min_train=min_train)
    assert sorted(rows(train) + rows(test)) == rows(it)  # union is everything
    assert not set(train.item_id.tolist()) & set(test.item_id.tolist())  # disjoint
    assert (np.diff(train.item_id) > 0).all() and (np.diff(test.item_id) > 0).all()  # log order
    for u in range(NUM_USERS):
        tr, te = train.timestamp[train.user_id == u], test.timestamp[test.user_id == u]
        count = len(tr) + len(te)
        if len(te):
            assert te.min() >= tr.max(initial=te.min())  # test never earlier than train
            assert len(tr) >= min_train
            assert count * frac - 1e-6 <= len(te) < count * frac + 1  # ceil(frac * count)
        else:  # nothing to hold out, or too few to hold out and keep min_train
            assert (
                np.ceil(count * frac - 1e-6) == 0
                or count - np.ceil(count * frac - 1e-6) < min_train
            )


def test_split_is_deterministic_on_ties():
    it = Interactions(np.zeros(5, np.int64), np.arange(5, dtype=np.int64), np.full(5, 9, np.int64))
    train, test = split_by_time(it, test_fraction=0.4)
    assert train.item_id.tolist() == [0, 1, 2] and test.item_id.tolist() == [3, 4]  # log order


def test_split_fraction_is_exact_despite_float_rounding():
    it = Interactions(
        np.zeros(30, np.int64), np.arange(30, dtype=np.int64), np.arange(30, dtype=np.int64)
    )
    assert len(split_by_time(it, test_fraction=0.1)[1]) == 3  # 0.1 * 30 = 3.0000000000000004


def test_split_rejects_bad_fraction():
    it = Interactions(*(np.zeros(1, np.int64) for _ in range(3)))
    with pytest.raises(ValueError, match="test_fraction"):
        split_by_time(it, test_fraction=1.0)


def reference_history(it: Interactions, user: int, max_len: int) -> list[int]:
    """The user's items by (timestamp, log position), the latest max_len, newest first."""
    mine = np.flatnonzero(it.user_id == user)
    by_time = mine[np.lexsort((mine, it.timestamp[mine]))]
    return it.item_id[by_time][::-1][:max_len].tolist()


@settings(max_examples=200, deadline=None)
@given(it=interactions(), max_len=st.integers(0, 10))
def test_history_keeps_the_most_recent_items(it, max_len):
    newest, lengths = history_by_user(it, NUM_USERS, max_len)
    oldest, lengths2 = history_by_user(it, NUM_USERS, max_len, newest_first=False)
    assert newest.shape == oldest.shape == (NUM_USERS, max_len) and newest.dtype == np.int64
    assert np.array_equal(lengths, lengths2)
    for u in range(NUM_USERS):
        want = reference_history(it, u, max_len)
        assert lengths[u] == len(want)
        assert newest[u, : len(want)].tolist() == want
        assert oldest[u, : len(want)].tolist() == want[::-1]
        assert (newest[u, len(want) :] == -1).all() and (oldest[u, len(want) :] == -1).all()


def test_history_is_fast_on_a_million_rows():
    rng = np.random.default_rng(0)
    m, u = 1_000_000, 50_000
    it = Interactions(rng.integers(0, u, m), rng.integers(0, 10_000, m), rng.integers(0, 10**9, m))
    hist, lengths = history_by_user(it, u, 50)
    assert lengths.sum() == np.minimum(np.bincount(it.user_id, minlength=u), 50).sum()
    assert hist.shape == (u, 50)


def test_history_rejects_unknown_users():
    it = Interactions(np.array([3]), np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match=r"interactions\.user_id"):
        history_by_user(it, num_users=2, max_len=4)
