"""The synthetic generator: deterministic, valid, and shaped like real traffic."""

from __future__ import annotations

import time

import numpy as np
import pytest

from retrieval.data import SyntheticConfig, generate, item_topics
from retrieval.data.synthetic import DENSE_FEATURES


@pytest.fixture(scope="module")
def cfg() -> SyntheticConfig:
    return SyntheticConfig()


@pytest.fixture(scope="module")
def ds(cfg):
    return generate(cfg)


def test_same_seed_same_arrays_other_seed_differs(cfg, ds):
    again = generate(SyntheticConfig())
    for f in ("user_id", "item_id", "timestamp"):
        assert np.array_equal(getattr(ds.interactions, f), getattr(again.interactions, f))
    for k, v in ds.item_attributes.items():
        assert np.array_equal(v, again.item_attributes[k])
    for k, v in ds.user_features.items():
        assert np.array_equal(v, again.user_features[k])
    assert np.array_equal(ds.user_dense, again.user_dense)
    other = generate(SyntheticConfig(seed=1))
    assert not np.array_equal(ds.item_attributes["language"], other.item_attributes["language"])


def test_shapes_and_validate(cfg, ds):
    ds.validate()
    assert (ds.num_users, ds.num_items) == (cfg.num_users, cfg.num_items)
    assert set(ds.item_attributes) == {"category", "language", "region", "age_rating", "available"}
    assert all(v.shape == (cfg.num_items,) for v in ds.item_attributes.values())
    assert ds.attribute_values["available"] == ["false", "true"]
    assert ds.attribute_values["age_rating"] == ["all", "7+", "13+", "16+", "18+"]
    assert set(ds.user_features) == {"region", "age_bucket", "preferred_language"}
    assert ds.user_dense.shape == (cfg.num_users, len(DENSE_FEATURES))
    assert np.allclose(ds.user_dense.mean(0), 0, atol=1e-4)
    assert np.allclose(ds.user_dense.std(0), 1, atol=1e-3)


def test_activity_spread_and_no_repeats(cfg, ds):
    it = ds.interactions
    per_user = np.bincount(it.user_id, minlength=cfg.num_users)
    assert 32 < per_user.mean() < 48 and per_user.min() >= cfg.min_interactions
    assert per_user.std() > 10  # heavy and light users
    assert len(np.unique(it.user_id * ds.num_items + it.item_id)) == len(it)


def test_zipf_popularity(ds):
    counts = np.sort(np.bincount(ds.interactions.item_id, minlength=ds.num_items))[::-1]
    top = ds.num_items // 100
    assert counts[:top].sum() / counts.sum() > 0.15  # top 1% of items: a large share
    assert counts[ds.num_items // 2 :].sum() / counts.sum() < 0.15  # a long, thin tail


def test_users_concentrate_on_few_topics(cfg, ds):
    it = ds.interactions
    topic = item_topics(cfg)[it.item_id]  # [M]
    per_user = np.bincount(
        it.user_id * cfg.num_topics + topic, minlength=cfg.num_users * cfg.num_topics
    ).reshape(cfg.num_users, cfg.num_topics)
    top3 = np.sort(per_user, axis=1)[:, -3:].sum(1) / per_user.sum(1)
    assert top3.mean() > 0.8
    overall = np.bincount(topic, minlength=cfg.num_topics) / len(topic)
    assert np.sort(overall)[-3:].sum() < 0.6  # but the population covers many topics


def test_attribute_distributions(cfg, ds):
    share = {k: np.bincount(v, minlength=len(ds.attribute_values[k])) / cfg.num_items
             for k, v in ds.item_attributes.items()}  # fmt: skip
    assert 0.85 < share["available"][1] < 0.95
    assert share["language"].argmax() == ds.attribute_values["language"].index("en")
    assert share["language"][0] > 0.35 and len(share["language"]) == 8
    assert len(share["category"]) == 12 and (share["category"] > 0.02).all()
    assert len(share["region"]) == 6 and (share["region"] > 0.02).all()
    assert (share["age_rating"] > 0.03).all()
    # category follows the latent topic: one category dominates every topic
    topic = item_topics(cfg)
    table = np.zeros((cfg.num_topics, 12))
    np.add.at(table, (topic, ds.item_attributes["category"]), 1)
    assert (table.max(1) / table.sum(1)).min() > 0.6


def test_timestamps_increase_per_user(ds):
    it = ds.interactions
    order = np.lexsort((np.arange(len(it)), it.user_id))  # rows of each user, log order
    same_user = np.diff(it.user_id[order]) == 0
    assert (np.diff(it.timestamp[order])[same_user] > 0).all()
    assert it.timestamp.min() >= 1_600_000_000


def test_large_catalog_is_fast():
    start = time.perf_counter()
    ds = generate(SyntheticConfig(num_users=500, num_items=1_000_000, seed=3))
    assert time.perf_counter() - start < 5.0
    assert ds.num_items == 1_000_000 and ds.interactions.item_id.max() < 1_000_000


@pytest.mark.parametrize(
    ("field", "overrides"),
    [
        ("num_items", {"num_items": 0}),
        ("topics_per_user", {"topics_per_user": (2, 1)}),
        ("topics_per_user", {"num_topics": 2}),
        ("explore", {"explore": 1.5}),
    ],
)
def test_config_errors_name_the_field(field, overrides):
    with pytest.raises(ValueError, match=field):
        generate(SyntheticConfig(**overrides))


def test_tiny_configs_work():
    ds = generate(SyntheticConfig(num_users=3, num_items=4, num_topics=10, topics_per_user=(1, 3)))
    ds.validate()
    assert len(ds.interactions) >= 3
