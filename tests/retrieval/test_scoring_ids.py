"""A model trained on imported data keeps its raw ids through save/load, tiering and document
sharding, and offline scoring reads and writes them (in process: ``score_table``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from retrieval.artifact import load_model, load_whole_model, save_model, save_sharded
from retrieval.batch_scoring import ScoreInputError, ScoreJob, check_input, score_table
from retrieval.data import read_parquet
from retrieval.data.id_map import ITEM_IDS_FILE
from retrieval.data.import_config import ImportConfig
from retrieval.data.importer import import_data
from retrieval.data.score_users import score_users_table
from retrieval.model import RetrievalModel
from retrieval.tiering import tier_model
from retrieval.training.prepare import Prepared, prepare
from sharded_tables.placement import Budgets


def built(tmp: Path) -> tuple[RetrievalModel, Prepared]:
    """An untrained model with its index, over an imported log of 12 string-id items."""
    rng = np.random.default_rng(0)
    rows = [f"u{rng.integers(8)},item-{rng.integers(12):02d},{t}" for t in range(120)]
    (tmp / "log.csv").write_text("user_id,item_id,timestamp\n" + "\n".join(rows) + "\n")
    import_data(ImportConfig(interactions=tmp / "log.csv", out=tmp / "data"))
    ds = read_parquet(tmp / "data")
    prep = prepare(ds, history_len=5, embedding_dim=8, hidden=(8,), out_dim=8)
    model = RetrievalModel(prep.config)
    model.id_maps = ds.ids
    model.build_index(prep.train.item_features, ds.item_attributes, prep.tune_batch())
    return model.eval(), prep


def test_the_id_maps_survive_save_tiering_and_shards(tmp_path: Path) -> None:
    model, _ = built(tmp_path)
    raw = model.id_maps.items.raw.to_pylist() if model.id_maps else []
    assert raw == [f"item-{i:02d}" for i in range(12)]
    again = load_model(save_model(model, tmp_path / "m"))
    assert again.id_maps is not None and again.id_maps.items.raw.to_pylist() == raw
    tiered, _ = tier_model(model, Budgets(device=0, host=1 << 30))
    assert tiered.id_maps is model.id_maps
    save_sharded(model, tmp_path / "router", tmp_path / "shards", 2)
    whole = load_whole_model(tmp_path / "router", tmp_path / "shards")
    assert whole.id_maps is not None and whole.id_maps.users.raw.to_pylist() == [
        f"u{i}" for i in range(8)
    ]


def test_a_map_that_does_not_fit_the_catalog_is_refused(tmp_path: Path) -> None:
    model, _ = built(tmp_path)
    folder = save_model(model, tmp_path / "m")
    (folder / ITEM_IDS_FILE).unlink()
    with pytest.raises(ValueError, match=r"item_ids\.parquet: missing"):
        load_model(folder)


def test_scoring_reads_raw_history_and_answers_raw_ids(tmp_path: Path) -> None:
    model, prep = built(tmp_path)
    folder = save_model(model, tmp_path / "m")
    users = score_users_table(prep.dataset, history_len=5)  # raw ids, every user
    job = ScoreJob(folder, 1, tmp_path / "users.parquet", tmp_path / "out", k=4)
    got = score_table(load_model(folder), users, job)
    assert got.column("user_id").to_pylist() == [f"u{i}" for i in range(8)]
    assert got.schema.field("item_ids").type == pa.list_(pa.string())
    # the same answers as the model's own dense ids, mapped
    dense = model(prep.user_batch(np.arange(8), history=_recent(prep)), 4)[0].numpy()
    raw = model.id_maps.items.raw.to_pylist() if model.id_maps else []
    want = [[raw[i] if i >= 0 else None for i in row] for row in dense]
    assert got.column("item_ids").to_pylist() == want


def test_scoring_reads_a_raw_seen_column(tmp_path: Path) -> None:
    model, prep = built(tmp_path)
    folder = save_model(model, tmp_path / "m")
    users = score_users_table(prep.dataset, history_len=5)
    seen = [[f"item-{(u + j) % 12:02d}" for j in range(u % 4)] for u in range(8)]  # 0-3 ids
    with_seen = users.append_column("seen", pa.array(seen))
    job = ScoreJob(folder, 1, tmp_path / "users.parquet", tmp_path / "out", k=4)
    got = score_table(load_model(folder), with_seen, job).column("item_ids").to_pylist()
    assert model.id_maps is not None
    dense = [model.id_maps.items.to_dense(pa.array(s, pa.string())).tolist() for s in seen]
    rows = np.full((8, 3), -1, dtype=np.int64)
    for u, d in enumerate(dense):
        rows[u, : len(d)] = d
    batch = prep.user_batch(np.arange(8), history=_recent(prep))
    batch.seen = torch.from_numpy(rows)
    want = model(batch, 4)[0].numpy()
    raw = model.id_maps.items.raw.to_pylist()
    assert got == [[raw[i] if i >= 0 else None for i in row] for row in want]
    assert all(not set(g) & set(s) for g, s in zip(got, seen, strict=True))
    import pyarrow.parquet as pq

    bad = users.append_column("seen", pa.array([["item-99"]] * 8))
    pq.write_table(bad, tmp_path / "users.parquet")
    with pytest.raises(ScoreInputError, match=r"column 'seen', row 0: item 'item-99' is not"):
        check_input(job)


def _recent(prep: Prepared) -> np.ndarray:
    """Each user's 5 most recent items over the whole log (what score_users.parquet holds)."""
    from retrieval.data import history_by_user

    return history_by_user(prep.dataset.interactions, prep.dataset.num_users, 5)[0]


def test_a_dense_history_of_the_wrong_type_is_refused_naming_the_column(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    model, _ = built(tmp_path)
    folder = save_model(model, tmp_path / "m")
    table = pa.table({
        "user_id": ["u0"],
        "history": pa.array([[1, 2]], pa.list_(pa.int64())),
        "categorical": pa.array([[]], pa.list_(pa.int64())),
        "dense": pa.array([[]], pa.list_(pa.float32())),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "users.parquet")
    job = ScoreJob(folder, 1, tmp_path / "users.parquet", tmp_path / "out", k=4)
    with pytest.raises(ScoreInputError, match="list<string> of the model's raw item ids"):
        check_input(job)
