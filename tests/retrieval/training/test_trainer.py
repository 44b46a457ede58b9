"""The trainer: fused fbgemm tables, resume == uninterrupted, NaN stops cleanly (its config's
errors: test_config.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.training.prepare import prepare
from retrieval.training.train import (
    CHECKPOINT_FILE,
    TrainConfig,
    Trainer,
    TrainingDivergedError,
)
from sharded_tables import EmbeddingCollection


@pytest.fixture(scope="module")
def prep():
    return prepare(generate(SyntheticConfig(num_users=300, num_items=400, seed=5)), history_len=10)


def fresh(prep) -> RetrievalModel:
    torch.manual_seed(0)
    return RetrievalModel(prep.config)


def run(prep, **kw) -> tuple[RetrievalModel, Trainer]:
    model = fresh(prep)
    cfg = TrainConfig(epochs=2, batch_size=128, progress=False, **kw)
    trainer = Trainer(model, prep.train, cfg)
    trainer.fit()
    return model, trainer


def same_state(a: RetrievalModel, b: RetrievalModel) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor)
    )


@pytest.mark.slow
def test_fused_tables_train_and_come_back_as_float_tables(prep):
    model, trainer = run(prep, random_negatives=64)
    assert isinstance(model.tables, EmbeddingCollection)
    assert trainer.epoch_losses[-1] < trainer.epoch_losses[0]
    before = fresh(prep).tables.bags()["item"].weight
    assert not torch.equal(model.tables.bags()["item"].weight, before)  # rows were trained


@pytest.mark.slow
def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(prep, tmp_path):
    whole, t_whole = run(prep, random_negatives=32)
    steps_per_epoch = len(prep.train.user_ids) // 128
    first = fresh(prep)
    cut = TrainConfig(
        epochs=2,
        batch_size=128,
        progress=False,
        random_negatives=32,
        checkpoint_dir=tmp_path,
        max_steps=steps_per_epoch + 3,  # stopped in the middle of the second epoch
    )
    Trainer(first, prep.train, cut).fit()
    second = fresh(prep)
    resumed = Trainer(second, prep.train, TrainConfig(**{**cut.__dict__, "max_steps": None}))
    resumed.resume(tmp_path / CHECKPOINT_FILE)
    assert resumed.global_step == steps_per_epoch + 3
    resumed.fit()
    assert resumed.epoch_losses == t_whole.epoch_losses
    assert same_state(second, whole)


def test_a_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(prep, tmp_path, monkeypatch):
    model = fresh(prep)
    cfg = TrainConfig(
        epochs=1, batch_size=64, progress=False, checkpoint_dir=tmp_path, checkpoint_every=1
    )
    trainer = Trainer(model, prep.train, cfg)
    real = trainer.step_loss

    def poisoned(idx, epoch, step):
        loss = real(idx, epoch, step)
        return loss * float("nan") if step == 3 else loss

    monkeypatch.setattr(trainer, "step_loss", poisoned)
    with pytest.raises(TrainingDivergedError, match=r"loss is nan at step 3 \(epoch 1, batch 3"):
        trainer.fit()
    saved = torch.load(tmp_path / CHECKPOINT_FILE, weights_only=True)
    assert saved["global_step"] == 3  # the last good step, not the poisoned one


def test_micro_batches_split_the_softmax_not_the_step(prep):
    split = Trainer(fresh(prep), prep.train, TrainConfig(batch_size=128, micro_batches=2))
    alone = Trainer(fresh(prep), prep.train, TrainConfig(batch_size=64))
    idx = np.arange(128)
    halves = (alone.step_loss(idx[:64], 0, 0) + alone.step_loss(idx[64:], 0, 0)) / 2
    torch.testing.assert_close(split.step_loss(idx, 0, 0), halves)


def test_a_run_stopped_at_max_steps_gives_back_float_tables(prep):
    model = fresh(prep)
    Trainer(model, prep.train, TrainConfig(batch_size=64, max_steps=2, progress=False)).fit()
    assert isinstance(model.tables, EmbeddingCollection)
