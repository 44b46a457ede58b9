"""RecDataset.validate names the bad field; parquet round trips are exact."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from retrieval.data import (
    Interactions,
    RecDataset,
    SyntheticConfig,
    generate,
    read_parquet,
    write_parquet,
)


def tiny() -> RecDataset:
    """3 items (multi-valued genre, boolean availability), 2 users, 3 events."""
    return RecDataset(
        name="tiny",
        num_users=2,
        num_items=3,
        item_attributes={
            "genre": np.array([[1, 0, 0], [0, 1, 1], [0, 0, 0]], dtype=bool),
            "available": np.array([1, 1, 0], dtype=np.int64),
        },
        attribute_values={"genre": ["Comedy", "Drama", "Sci-Fi"], "available": ["false", "true"]},
        user_features={"region": np.array([0, 1], dtype=np.int64)},
        user_feature_sizes={"region": 2},
        user_dense=np.array([[0.5], [-0.5]], dtype=np.float32),
        interactions=Interactions(
            np.array([0, 1, 0], dtype=np.int64),
            np.array([2, 0, 1], dtype=np.int64),
            np.array([10, 20, 30], dtype=np.int64),
        ),
        item_names=["Amélie (2001)", "", "Heat"],
    )


def assert_same(a: RecDataset, b: RecDataset) -> None:
    assert (a.name, a.num_users, a.num_items) == (b.name, b.num_users, b.num_items)
    assert a.attribute_values == b.attribute_values and a.user_feature_sizes == b.user_feature_sizes
    assert list(a.item_attributes) == list(b.item_attributes)
    assert list(a.user_features) == list(b.user_features)
    for k, v in a.item_attributes.items():
        assert b.item_attributes[k].dtype == v.dtype and np.array_equal(b.item_attributes[k], v)
    for k, v in a.user_features.items():
        assert b.user_features[k].dtype == v.dtype and np.array_equal(b.user_features[k], v)
    assert b.user_dense.dtype == np.float32 and np.array_equal(b.user_dense, a.user_dense)
    for f in ("user_id", "item_id", "timestamp"):
        assert np.array_equal(getattr(b.interactions, f), getattr(a.interactions, f))
    va, vb = a.interactions.value, b.interactions.value
    assert (va is None and vb is None) or np.array_equal(va, vb)
    assert a.item_names == b.item_names


def test_tiny_is_valid_and_select_works():
    ds = tiny()
    ds.validate()
    assert len(ds.interactions) == 3
    picked = ds.interactions.select(np.array([True, False, True]))
    assert picked.item_id.tolist() == [2, 1] and len(picked) == 2
    assert ds.interactions.select(np.array([2, 0])).timestamp.tolist() == [30, 10]


@pytest.mark.parametrize(
    ("field", "corrupt"),
    [
        ("user_dense", lambda ds: setattr(ds, "user_dense", ds.user_dense[:1])),
        ("user_dense", lambda ds: setattr(ds, "user_dense", ds.user_dense.astype(np.float64))),
        ("user_dense", lambda ds: ds.user_dense.__setitem__((0, 0), np.nan)),
        (
            "item_attributes['genre']",
            lambda ds: ds.item_attributes.__setitem__("genre", np.ones((3, 2), bool)),
        ),
        (
            "item_attributes['available']",
            lambda ds: ds.item_attributes.__setitem__("available", np.array([0, 1, 2])),
        ),
        (
            "item_attributes['available']",
            lambda ds: ds.item_attributes.__setitem__("available", np.array([0.0, 1.0, 1.0])),
        ),
        ("attribute_values", lambda ds: ds.attribute_values.pop("available")),
        (
            "attribute_values['genre']",
            lambda ds: ds.attribute_values.__setitem__("genre", ["a", "a", "b"]),
        ),
        (
            "user_features['region']",
            lambda ds: ds.user_features.__setitem__("region", np.array([0, 1, 1])),
        ),
        ("user_feature_sizes['region']", lambda ds: ds.user_feature_sizes.__setitem__("region", 0)),
        ("user_features", lambda ds: ds.user_feature_sizes.__setitem__("age", 3)),
        ("interactions.item_id", lambda ds: ds.interactions.item_id.__setitem__(0, 3)),
        ("interactions.user_id", lambda ds: ds.interactions.user_id.__setitem__(0, -1)),
        ("interactions.timestamp", lambda ds: setattr(ds.interactions, "timestamp", np.arange(2))),
        (
            "interactions.item_id",
            lambda ds: setattr(ds.interactions, "item_id", np.arange(3, dtype=np.int32)),
        ),
        ("item_names", lambda ds: setattr(ds, "item_names", ["a"])),
        ("num_items", lambda ds: setattr(ds, "num_items", -1)),
    ],
)
def test_validate_names_the_field(field, corrupt):
    ds = tiny()
    corrupt(ds)
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        ds.validate()


def test_round_trip_multi_valued_and_names(tmp_path: Path):
    ds = tiny()
    assert_same(ds, read_parquet(write_parquet(ds, tmp_path / "tiny")))
    assert {p.name for p in (tmp_path / "tiny").iterdir()} == {
        "items.parquet", "users.parquet", "interactions.parquet", "meta.json"
    }  # fmt: skip


def test_round_trip_synthetic(tmp_path: Path):
    ds = generate(SyntheticConfig(num_users=300, num_items=500, seed=2))
    assert_same(ds, read_parquet(write_parquet(ds, tmp_path)))


def test_round_trip_empty_parts(tmp_path: Path):
    ds = tiny()
    ds.user_dense = np.zeros((2, 0), np.float32)
    ds.item_names = None
    ds.interactions = ds.interactions.select(np.zeros(3, bool))
    assert_same(ds, read_parquet(write_parquet(ds, tmp_path)))


def test_write_rejects_reserved_names(tmp_path: Path):
    ds = tiny()
    ds.user_features["dense_0"] = ds.user_features.pop("region")
    ds.user_feature_sizes["dense_0"] = ds.user_feature_sizes.pop("region")
    with pytest.raises(ValueError, match=r"user_features\['dense_0'\]"):
        write_parquet(ds, tmp_path)


def test_read_explains_missing_folder(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"meta\.json"):
        read_parquet(tmp_path)
