"""Seen-item exclusion beyond the history window: the SeenSets store and the model's forward."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.data import SyntheticConfig, generate
from retrieval.index.ivf import IVFConfig
from retrieval.model import RetrievalModel
from retrieval.seen import SeenSets, pad_lists
from retrieval.training.prepare import prepare

pairs = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 30)), max_size=60)


@given(pairs)
@settings(max_examples=60, deadline=None)
def test_rows_and_indicator_hold_each_users_distinct_items(events):
    users = np.array([u for u, _ in events], dtype=np.int64)
    items = np.array([i for _, i in events], dtype=np.int64)
    seen = SeenSets.of(users, items, num_users=6)
    want = [sorted({i for u, i in events if u == user}) for user in range(6)]
    order = np.array([5, 0, 3, 3, 1])
    rows = seen.rows(order)
    assert rows.shape == (5, max(len(want[u]) for u in order))
    for row, u in zip(rows.tolist(), order.tolist(), strict=True):
        assert row == want[u] + [-1] * (rows.shape[1] - len(want[u]))
    ind = seen.indicator(order, 31)
    for row, u in zip(ind.tolist(), order.tolist(), strict=True):
        assert [j for j, x in enumerate(row) if x] == want[u]
    assert seen.lengths().tolist() == [len(w) for w in want]
    assert seen.nbytes() == 8 * (7 + sum(len(w) for w in want))


def test_huge_item_ids_keep_each_users_items():
    """Items near 2**62: a pair packed as one int64 (user * (max item + 1) + item) overflowed
    and moved items to other users; sorted as two keys they stay with their user."""
    big = 1 << 62
    seen = SeenSets.of(np.array([0, 2, 2, 0]), np.array([big, 5, big, big]), num_users=3)
    assert seen.rows(np.arange(3)).tolist() == [[big, -1], [-1, -1], [5, big]]


def test_rows_pads_to_a_width_and_refuses_one_too_narrow():
    seen = SeenSets.of(np.array([0, 0, 1]), np.array([4, 2, 9]), num_users=3)
    assert seen.rows(np.array([1, 2]), width=3).tolist() == [[9, -1, -1], [-1, -1, -1]]
    assert seen.rows(np.array([2])).shape == (1, 0)
    with pytest.raises(ValueError, match="width"):
        seen.rows(np.array([0]), width=1)


@pytest.mark.parametrize(
    ("users", "items", "match"),
    [
        (np.array([0, 3]), np.array([1, 1]), "user_ids"),
        (np.array([0, 1]), np.array([1, -2]), "item_ids"),
        (np.array([0, 1]), np.array([1]), "user_ids and item_ids"),
    ],
)
def test_bad_pairs_are_refused_naming_the_array(users, items, match):
    with pytest.raises(ValueError, match=match):
        SeenSets.of(users, items, num_users=3)


@pytest.fixture(scope="module")
def small():
    """An untrained model over a catalog where every user consumed more than the window."""
    ds = generate(SyntheticConfig(num_users=120, num_items=400, seed=2))
    prep = prepare(ds, history_len=4, index=IVFConfig(nlist=8, nprobe=2))
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, ds.item_attributes)
    assert prep.seen is not None
    users = np.flatnonzero(prep.seen.lengths() > 4)[:32]
    assert len(users) >= 8  # the fixture exercises lists longer than the window
    return prep, model.eval(), users


@pytest.mark.parametrize("exact", [False, True])
def test_a_seen_list_excludes_every_consumed_item(small, exact):
    prep, model, users = small
    with torch.no_grad():
        window = model(prep.user_batch(users), 30, exact=exact)[0]
        full = model(prep.user_batch(users, seen=prep.seen), 30, exact=exact)[0]
    consumed = [set(prep.seen.rows(np.array([u]))[0].tolist()) for u in users]
    assert all(not (set(r) & c) for r, c in zip(full.tolist(), consumed, strict=True))
    assert (full >= 0).all()  # K still filled: the index returned K + S candidates
    # the window alone lets older consumed items through (what the seen list is for)
    assert any(set(r) & c for r, c in zip(window.tolist(), consumed, strict=True))


def test_without_a_seen_list_the_window_is_excluded_as_before(small):
    prep, model, users = small
    batch = prep.user_batch(users)
    empty = copy.copy(batch)
    empty.seen = torch.zeros(len(users), 0, dtype=torch.int64)
    with torch.no_grad():
        ids = model(batch, 30)[0]
        assert torch.equal(ids, model(empty, 30)[0])
    hist = [set(h[h >= 0].tolist()) for h in prep.history[users]]
    assert all(not (set(r) & h) for r, h in zip(ids.tolist(), hist, strict=True))


def test_exclude_history_off_still_excludes_a_seen_list(small):
    prep, model, users = small
    other = copy.deepcopy(model)
    other.config.exclude_history = False
    batch = prep.user_batch(
        users[:4], seen=SeenSets.of(users[:4], np.zeros(4, np.int64) + 7, prep.dataset.num_users)
    )
    with torch.no_grad():
        ids = other(batch, 400)[0]
    assert not (ids == 7).any() and (ids[:, :-1] >= 0).all()


@pytest.mark.parametrize(
    ("seen", "match"),
    [
        (torch.zeros(3, 2, dtype=torch.int64), r"seen: expected int64 \[4, S\]"),
        (torch.zeros(4, dtype=torch.int64), r"seen: expected int64 \[4, S\]"),
        (torch.zeros(4, 2, dtype=torch.int32), r"seen: expected int64"),
        (torch.full((4, 2), -3, dtype=torch.int64), "seen: item ids are >= 0"),
    ],
)
def test_a_bad_seen_list_is_refused_naming_the_field(small, seen, match):
    prep, model, users = small
    batch = prep.user_batch(users[:4])
    batch.seen = seen
    with pytest.raises(ValueError, match=match):
        model(batch, 10)


@pytest.mark.slow
@pytest.mark.multiproc  # inductor compile workers
def test_torch_compile_with_a_seen_list_equals_eager(small):
    prep, model, users = small
    batch = prep.user_batch(users, seen=prep.seen)
    with torch.no_grad():
        eager = model(batch, 30)[0]
        compiled = torch.compile(model)(batch, 30)[0]
    assert torch.equal(eager, compiled)


def test_pad_lists_pads_each_request_to_the_longest_and_none_without_any():
    rows = pad_lists([np.array([7, 3], np.int64), None, np.array([], np.int64), np.array([9])])
    assert rows is not None and rows.dtype == torch.int64
    assert rows.tolist() == [[7, 3], [-1, -1], [-1, -1], [9, -1]]
    assert pad_lists([None, np.array([], np.int64)]) is None  # the common path: no tensor
    assert pad_lists([]) is None
