"""The model's seen store (``retrieval/seen_store.py``): rows equal the CSR lists, updates grow
it without touching the old store, it travels in the state dict, and a request naming its user
is answered like one carrying the user's seen list."""

from __future__ import annotations

import copy
import io

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.config import ModelConfig
from retrieval.features import UserBatch
from retrieval.model import RetrievalModel
from retrieval.seen import SeenSets
from retrieval.seen_store import SeenStore

PAIRS = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 30)), max_size=60)


def _lists(pairs: list[tuple[int, int]], num_users: int) -> list[list[int]]:
    out: list[set[int]] = [set() for _ in range(num_users)]
    for u, i in pairs:
        out[u].add(i)
    return [sorted(s) for s in out]


@settings(max_examples=60, deadline=None)
@given(pairs=PAIRS, more=PAIRS, users=st.lists(st.integers(-1, 14), min_size=1, max_size=8))
def test_rows_and_updates_equal_python_sets(pairs, more, users):
    u = np.array([p[0] for p in pairs], dtype=np.int64)
    i = np.array([p[1] for p in pairs], dtype=np.int64)
    store = SeenStore.of(u, i, num_users=10)
    grown = store.with_pairs(
        torch.tensor([p[0] + 3 for p in more], dtype=torch.int64),  # users up to 12: it grows
        torch.tensor([p[1] for p in more], dtype=torch.int64),
    )
    for s, all_pairs, n in ((store, pairs, 10), (grown, pairs + [(a + 3, b) for a, b in more], 13)):
        want = _lists(all_pairs, max(n, s.num_users))
        rows = s.rows(torch.tensor(users))
        for row, user in zip(rows.tolist(), users, strict=True):
            expect = want[user] if 0 <= user < s.num_users else []
            assert [x for x in row if x >= 0] == expect
            assert row[len(expect) :] == [-1] * (len(row) - len(expect))
    assert store.num_users == 10  # the old store is untouched
    assert store.nbytes() == 8 * (11 + store.items.numel())


def _model(seen_store: bool) -> RetrievalModel:
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_items=200,
        user_features={},
        dense_dim=0,
        item_attributes={},
        history_len=4,
        recent_len=0,
        seen_store=seen_store,
    )
    cfg.index.nlist, cfg.index.nprobe = 8, 8
    model = RetrievalModel(cfg).eval()
    items = {"item_id": torch.arange(200).view(-1, 1)}
    model.build_index(items, {})
    return model


def test_a_named_user_is_answered_as_if_it_sent_its_list():
    model = _model(seen_store=True)
    rng = np.random.default_rng(0)
    users = rng.integers(0, 5, 300)
    items = rng.integers(0, 200, 300)
    model.seen_store = SeenStore.of(users, items, num_users=5)
    sets = SeenSets.of(users, items, 5)
    b = 5
    base = dict(
        history=torch.full((b, 4), -1, dtype=torch.int64),
        categorical=torch.zeros(b, 0, dtype=torch.int64),
        dense=torch.zeros(b, 0),
        filter_masks=torch.zeros(b, 0, model.index.schema.num_words, dtype=torch.int64),
        filter_negate=torch.zeros(b, 0, dtype=torch.bool),
    )
    with torch.inference_mode():
        named = model(UserBatch(**base, user=torch.arange(b)), 20)[0]
        sent = model(UserBatch(**base, seen=sets.rows(np.arange(b))), 20)[0]
        plain = model(UserBatch(**base), 20)[0]
    assert torch.equal(named, sent) and not torch.equal(named, plain)
    for row in range(b):
        assert not set(named[row].tolist()) & set(sets.rows(np.array([row]))[0].tolist())


def test_the_store_travels_in_the_state_dict_and_old_configs_load_without_it():
    model = _model(seen_store=True)
    model.seen_store = SeenStore.of(np.array([0, 3]), np.array([7, 9]), num_users=4)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    again = _model(seen_store=True)
    again.load_state_dict(torch.load(buf))
    assert again.seen_store is not None
    assert again.seen_store.rows(torch.tensor([3])).tolist() == [[9]]
    d = copy.deepcopy(model.config.to_dict())
    d.pop("seen_store")  # a config saved before the field
    assert ModelConfig.from_dict(d).seen_store is False
