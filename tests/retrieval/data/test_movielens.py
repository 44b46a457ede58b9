"""MovieLens 100k loader against the real files (``make test`` fetches them first)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from retrieval.data import fetch_movielens, load_movielens, read_parquet, write_parquet
from retrieval.data import movielens as ml

ML100K = Path(__file__).parents[3] / "data" / "ml-100k"


@pytest.fixture(scope="module")
def ds():
    return load_movielens(ML100K)


def test_counts(ds):
    assert (ds.num_users, ds.num_items, len(ds.interactions)) == (943, 1682, 100_000)
    per_user = np.bincount(ds.interactions.user_id, minlength=ds.num_users)
    assert per_user.min() == 20  # the 100k release keeps users with >= 20 ratings
    assert (
        len(np.unique(ds.interactions.user_id * ds.num_items + ds.interactions.item_id)) == 100_000
    )


def test_item_attributes_and_names(ds):
    genres = ds.attribute_values["genre"]
    assert len(genres) == 19 and {"Action", "Film-Noir", "Children's", "Sci-Fi", "unknown"} <= set(
        genres
    )
    assert ds.item_attributes["genre"].shape == (1682, 19)
    assert ds.item_attributes["genre"].sum(axis=1).min() >= 1  # every movie has a genre
    assert ds.item_names is not None and len(ds.item_names) == 1682
    assert ds.item_names[0] == "Toy Story (1995)"  # raw item id 1 -> dense id 0
    assert "Misérables, Les (1995)" in ds.item_names  # the files are UTF-8
    toy_story = ds.item_attributes["genre"][0]
    assert {genres[j] for j in np.flatnonzero(toy_story)} == {"Animation", "Children's", "Comedy"}
    decades = ds.attribute_values["decade"]
    assert decades[-1] == "unknown" and decades[ds.item_attributes["decade"][0]] == "1990s"


def test_user_features(ds):
    assert ds.user_feature_sizes == {"age_bucket": 7, "gender": 2, "occupation": 21}
    assert ds.user_dense.shape == (943, 2)
    assert np.allclose(ds.user_dense.mean(0), 0, atol=1e-5)
    assert ds.user_features["age_bucket"][0] == 1  # user 1 is 24: the 18-24 group


def test_min_rating_keeps_users(ds):
    liked = load_movielens(ML100K, min_rating=4)
    assert liked.num_users == 943 and 50_000 < len(liked.interactions) < 60_000


def test_parquet_round_trip(ds, tmp_path):
    back = read_parquet(write_parquet(ds, tmp_path))
    assert np.array_equal(back.item_attributes["genre"], ds.item_attributes["genre"])
    assert back.item_names == ds.item_names
    assert np.array_equal(back.interactions.timestamp, ds.interactions.timestamp)
    ratings = ds.interactions.value
    assert ratings is not None and set(np.unique(ratings)) == {1, 2, 3, 4, 5}
    assert np.array_equal(back.interactions.value, ds.interactions.value)  # the ratings


def test_missing_files_say_how_to_fetch(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"make data.*recserve data movielens"):
        load_movielens(tmp_path)


def test_fetch_is_a_no_op_when_present(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("must not download"))
    assert fetch_movielens(ML100K) == ML100K


def test_fetch_failure_is_explained(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(ml.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RuntimeError, match=r"recbole==1\.2\.1.*No matching distribution"):
        fetch_movielens(tmp_path / "ml")


def test_odd_rows(ds):
    decades = ds.attribute_values["decade"]
    assert ds.item_names[266] == "unkonwn"  # item 267: title and year are "unkonwn" in the file
    assert decades[ds.item_attributes["decade"][266]] == "unknown"
    land = ds.item_names[1411]  # item 1412: year column "V", the year sits in the title
    assert land.endswith("Giving (1995)") and decades[ds.item_attributes["decade"][1411]] == "1990s"
