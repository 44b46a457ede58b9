"""Synthetic generator, MovieLens loader, parquet round trip, time split (property tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.data import (
    Interactions, SyntheticConfig, generate, history_by_user, load_movielens, read_parquet,
    split_by_time, write_parquet,
)
from retrieval.data.synthetic import item_topics

ML100K = Path(__file__).parents[3] / "data" / "ml-100k"


def test_synthetic_is_deterministic_and_valid():
    a, b = generate(SyntheticConfig(seed=4)), generate(SyntheticConfig(seed=4))
    assert np.array_equal(a.interactions.item_id, b.interactions.item_id)
    assert np.array_equal(a.item_attributes["language"], b.item_attributes["language"])
    assert not np.array_equal(a.interactions.item_id, generate(SyntheticConfig(seed=5)).interactions.item_id)
    a.validate()


def test_synthetic_looks_like_traffic():
    cfg = SyntheticConfig(num_users=3000, num_items=5000)
    ds = generate(cfg)
    counts = np.sort(np.bincount(ds.interactions.item_id, minlength=ds.num_items))[::-1]
    assert counts[: ds.num_items // 100].sum() / counts.sum() > 0.15  # top 1% of items: a large share
    topic = item_topics(cfg)[ds.interactions.item_id]
    shares = []
    for u in range(200):
        t = topic[ds.interactions.user_id == u]
        shares.append(np.sort(np.bincount(t, minlength=cfg.num_topics))[::-1][:3].sum() / len(t))
    assert np.mean(shares) > 0.8  # users concentrate on a few topics
    avail = ds.item_attributes["available"].mean()
    assert 0.85 < avail < 0.95
    assert np.bincount(ds.item_attributes["language"]).argmax() == ds.attribute_values["language"].index("en")
    it = ds.interactions
    for u in range(20):  # increasing timestamps per user
        assert np.all(np.diff(it.timestamp[it.user_id == u]) > 0)


def test_parquet_round_trip(tmp_path):
    ds = generate(SyntheticConfig(num_users=200, num_items=300))
    back = read_parquet(write_parquet(ds, tmp_path / "ds"))
    assert back.name == ds.name and back.attribute_values == ds.attribute_values
    for k, v in ds.item_attributes.items():
        assert np.array_equal(back.item_attributes[k], v)
    for k, v in ds.user_features.items():
        assert np.array_equal(back.user_features[k], v)
    assert np.array_equal(back.user_dense, ds.user_dense)
    for f in ("user_id", "item_id", "timestamp"):
        assert np.array_equal(getattr(back.interactions, f), getattr(ds.interactions, f))


def test_parquet_round_trip_multi_valued(tmp_path):
    ds = load_movielens(ML100K)
    back = read_parquet(write_parquet(ds, tmp_path / "ml"))
    assert np.array_equal(back.item_attributes["genre"], ds.item_attributes["genre"])
    assert back.item_names == ds.item_names


def test_movielens_100k_counts():
    ds = load_movielens(ML100K)
    assert (ds.num_users, ds.num_items, len(ds.interactions)) == (943, 1682, 100_000)
    assert len(ds.attribute_values["genre"]) == 19
    assert ds.item_names is not None and ds.item_names[0].startswith("Toy Story")
    assert ds.item_attributes["genre"].sum(axis=1).min() >= 1
    assert set(ds.user_features) == {"age_bucket", "gender", "occupation"}


def test_missing_movielens_says_how_to_fetch(tmp_path):
    with pytest.raises(FileNotFoundError, match="fetch-movielens"):
        load_movielens(tmp_path)


def test_validate_names_the_field():
    ds = generate(SyntheticConfig(num_users=50, num_items=60))
    ds.user_dense = ds.user_dense[:10]
    with pytest.raises(ValueError, match="user_dense"):
        ds.validate()


interactions = st.integers(1, 60).flatmap(lambda m: st.tuples(
    st.lists(st.integers(0, 6), min_size=m, max_size=m),
    st.lists(st.integers(0, 9), min_size=m, max_size=m),
    st.lists(st.integers(0, 20), min_size=m, max_size=m),
)).map(lambda t: Interactions(*(np.array(x, dtype=np.int64) for x in t)))


@settings(max_examples=150, deadline=None)
@given(it=interactions, frac=st.floats(0.0, 0.9))
def test_split_by_time_properties(it, frac):
    train, test = split_by_time(it, test_fraction=frac)
    assert len(train) + len(test) == len(it)
    all_rows = sorted(zip(it.user_id.tolist(), it.item_id.tolist(), it.timestamp.tolist()))
    got = sorted(zip(np.r_[train.user_id, test.user_id].tolist(), np.r_[train.item_id, test.item_id].tolist(),
                     np.r_[train.timestamp, test.timestamp].tolist()))
    assert got == all_rows
    for u in np.unique(it.user_id):
        tr, te = train.timestamp[train.user_id == u], test.timestamp[test.user_id == u]
        assert len(tr) >= 1  # every user keeps history
        if len(te):
            assert te.min() >= tr.max()
            assert len(te) == int(np.ceil((len(tr) + len(te)) * frac))


@settings(max_examples=100, deadline=None)
@given(it=interactions, max_len=st.integers(1, 8))
def test_history_keeps_the_most_recent_items(it, max_len):
    hist, lengths = history_by_user(it, 7, max_len)
    for u in range(7):
        mine = np.flatnonzero(it.user_id == u)
        order = mine[np.lexsort((mine, it.timestamp[mine]))][::-1][:max_len]
        assert lengths[u] == len(order)
        assert hist[u, : len(order)].tolist() == it.item_id[order].tolist()
        assert (hist[u, len(order):] == -1).all()
