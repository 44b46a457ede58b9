"""``[model] hashed_user_id``: the user's raw id as a hashed feature, trained over a working
table of a quarter of the users and an embedding server (in-process, loopback) that keeps the
rest with their optimizer state; resume equals an uninterrupted run; bad configs refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from retrieval.artifact import save_model
from retrieval.batch_scoring import score_table, users_table
from retrieval.data import SyntheticConfig, generate
from retrieval.data.raw_user_ids import raw_user_ids
from retrieval.live_updates import UpdateError, apply_update
from retrieval.model import RetrievalModel
from retrieval.score_input import ScoreJob, check_input
from retrieval.tiering import tier_model
from retrieval.training.config import HashedConfig, ModelSection
from retrieval.training.prepare import Prepared
from retrieval.training.run import prepare_run
from retrieval.training.train import CHECKPOINT_FILE, TrainConfig, Trainer
from retrieval.update_batches import UpdateEmbeddings
from serving.repository import ModelRepository
from sharded_tables import EmbeddingCollection
from sharded_tables.hashed_training import state_width, store_folder
from sharded_tables.placement import Budgets
from sharded_tables.remote.server import EmbeddingServer
from sharded_tables.specs import DType

USERS = 300
TABLE = "user_raw_id"


@pytest.fixture(scope="module")
def prep() -> Prepared:
    ds = generate(SyntheticConfig(num_users=USERS, num_items=400, seed=5))
    section = ModelSection(history_len=10, hashed_user_id=USERS // 4, index={"nlist": 4})
    return prepare_run(ds, section)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    width = 32 + state_width("rowwise_adagrad", 32)
    srv = EmbeddingServer(store_folder(tmp_path_factory.mktemp("store") / "s0", {TABLE: width}))
    yield srv.start()
    srv.stop(grace=0)


def fresh(prep: Prepared) -> RetrievalModel:
    torch.manual_seed(0)
    return RetrievalModel(prep.config)


def config(server: str, **kw: object) -> TrainConfig:
    settings: dict[str, object] = {"epochs": 2, "batch_size": 64, "progress": False, **kw}
    return TrainConfig(hashed=HashedConfig(servers=[server]), **settings)


@pytest.fixture(scope="module")
def trained(prep: Prepared, server: str) -> tuple[RetrievalModel, Trainer]:
    model = fresh(prep)
    trainer = Trainer(model, prep.train, config(server))
    trainer.fit()
    model.build_index(prep.train.item_features, prep.dataset.item_attributes)
    return model.eval(), trainer


def test_the_raw_id_feature_trains_over_a_quarter_sized_working_table(
    prep: Prepared, trained: tuple[RetrievalModel, Trainer]
) -> None:
    assert prep.config.hashed_user_features == ("raw_id",)
    raw = prep.train.categorical[:, list(prep.config.user_features).index("raw_id")]
    assert raw.min() >= 0 and len(np.unique(raw)) == USERS and raw.max() > 2**40  # sparse ids

    model, trainer = trained
    moved = trainer.hashed.moved if trainer.hashed is not None else None
    assert moved is not None and moved.evicted > USERS and moved.restored > 0
    assert trainer.epoch_losses[-1] < trainer.epoch_losses[0]

    assert isinstance(model.tables, EmbeddingCollection)
    keys, rows = model.tables.keyed_rows()[TABLE]
    trained = np.unique(raw[prep.train.user_ids])
    assert np.array_equal(keys.numpy(), trained)  # every user that trained, one row each
    assert rows.abs().sum(dim=1).min() > 0

    # the float model looks the users up by raw id: its query vectors are the trained ones
    batch = prep.user_batch(np.arange(8))
    with torch.no_grad():
        q = model.user_vectors(batch)
        unknown = batch.categorical.clone()
        unknown[:, list(prep.config.user_features).index("raw_id")] = 12345  # never trained
        q_unknown = model.user_vectors(dataclasses.replace(batch, categorical=unknown))
    assert not torch.allclose(q, q_unknown)


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_published_it_answers_like_the_trained_model(
    prep: Prepared, trained: tuple[RetrievalModel, Trainer], dtype: str, tmp_path: Path
) -> None:
    model, _ = trained
    served, remote = tier_model(model, Budgets(device=0, host=1 << 30), dtype=DType(dtype))
    assert remote == {}  # every table fits the host tier, the hashed one too
    repo = ModelRepository(tmp_path / "repo")
    version = repo.publish("hashed", served)
    loaded = repo.load("hashed", version).model
    batch = prep.user_batch(np.arange(64))
    with torch.no_grad():
        want, _ = model(batch, 20)
        got, _ = loaded(batch, 20)
    if dtype == "fp32":
        assert (got == want).float().mean() > 0.99  # fbgemm's sums against torch's
    else:  # within the int8 tables' bound the other tests hold
        overlap = [
            len(set(a.tolist()) & set(b.tolist())) / 20 for a, b in zip(got, want, strict=True)
        ]
        assert float(np.mean(overlap)) > 0.85


def test_resume_equals_an_uninterrupted_run(prep: Prepared, server: str, tmp_path: Path) -> None:
    whole = fresh(prep)
    Trainer(whole, prep.train, config(server)).fit()
    want = whole.tables.keyed_rows()[TABLE]

    steps_per_epoch = len(prep.train.user_ids) // 64
    cut = config(server, checkpoint_dir=tmp_path, max_steps=steps_per_epoch + 2)
    Trainer(fresh(prep), prep.train, cut).fit()
    # the killed run's store goes on past the checkpoint (more puts) before the resume
    resumed_model = fresh(prep)
    resumed = Trainer(resumed_model, prep.train, config(server, checkpoint_dir=tmp_path))
    resumed.resume(tmp_path / CHECKPOINT_FILE)
    resumed.fit()
    keys, rows = resumed_model.tables.keyed_rows()[TABLE]
    assert torch.equal(keys, want[0])
    torch.testing.assert_close(rows, want[1], rtol=0, atol=0)
    for name, bag in whole.tables.bags().items():
        assert torch.equal(bag.weight, resumed_model.tables.bags()[name].weight), name


def test_bad_configs_are_refused_naming_the_field(prep: Prepared, server: str) -> None:
    with pytest.raises(ValueError, match=r"train\.hashed\.servers: the model has hashed"):
        Trainer(fresh(prep), prep.train, TrainConfig(progress=False))
    with pytest.raises(ValueError, match=r"train\.table_optimizer: hashed tables"):
        Trainer(fresh(prep), prep.train, config(server, table_optimizer="adam"))
    with pytest.raises(ValueError, match=r"model\.hashed_user_id: .* fewer than a batch"):
        Trainer(fresh(prep), prep.train, config(server, batch_size=128))
    with pytest.raises(ValueError, match=r"train\.hashed\.servers: .* must hold table"):
        Trainer(fresh(prep), prep.train, config(server, table_optimizer="adagrad"))  # wider rows


def test_raw_user_ids_are_stable_distinct_and_never_padding() -> None:
    ds = generate(SyntheticConfig(num_users=50, num_items=60, seed=1))
    ids = raw_user_ids(ds)
    assert ids.dtype == np.int64 and (ids >= 0).all() and len(np.unique(ids)) == 50
    assert np.array_equal(ids, raw_user_ids(ds))


def test_live_updates_write_a_served_hashed_table(
    prep: Prepared, trained: tuple[RetrievalModel, Trainer]
) -> None:
    served, _ = tier_model(trained[0], Budgets(device=0, host=1 << 30), dtype=DType.INT8)
    col = list(prep.config.user_features).index("raw_id")
    batch = prep.user_batch(np.arange(2))
    newcomer = batch.categorical.clone()
    newcomer[:, col] = torch.tensor([2**62 + 1, 2**62 + 2])  # users the model never saw
    fresh_batch = dataclasses.replace(batch, categorical=newcomer)
    with torch.no_grad():
        before = served.user_vectors(fresh_batch)
    row = torch.ones(1, 32) * 0.5
    apply_update(served, UpdateEmbeddings(TABLE, torch.tensor([2**62 + 1]), row))
    with torch.no_grad():
        after = served.user_vectors(fresh_batch)
    assert not torch.allclose(after[0], before[0]) and torch.equal(after[1], before[1])
    with pytest.raises(UpdateError, match="not -1"):
        apply_update(served, UpdateEmbeddings(TABLE, torch.tensor([-1]), row))


def test_batch_scoring_takes_raw_ids(
    prep: Prepared, trained: tuple[RetrievalModel, Trainer], tmp_path: Path
) -> None:
    model = trained[0]
    save_model(model, tmp_path / "model")
    users = np.arange(40)
    pq.write_table(users_table(users, prep.user_batch(users)), tmp_path / "users.parquet")
    job = ScoreJob(tmp_path / "model", 1, tmp_path / "users.parquet", tmp_path / "out",
                   k=10, chunk_rows=20, batch_size=20, workers=1)  # fmt: skip
    check_input(job)  # raw ids in the categorical column pass the edge check
    got = score_table(model, pq.read_table(tmp_path / "users.parquet"), job)
    with torch.no_grad():
        want, _ = model(prep.user_batch(users), 10)
    assert got.column("item_ids").to_pylist() == want.tolist()
