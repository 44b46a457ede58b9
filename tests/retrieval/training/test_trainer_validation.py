"""The trainer with an evaluation each epoch: the best epoch's weights are kept, patience stops
the run, and an evaluation that raises never loses the epoch it was evaluating."""

from __future__ import annotations

import pytest
import torch

from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.training.early_stopping import EarlyStopping
from retrieval.training.prepare import prepare
from retrieval.training.train import CHECKPOINT_FILE, TrainConfig, Trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prep():
    ds = generate(SyntheticConfig(num_users=120, num_items=100, seed=4))
    return prepare(ds, history_len=8, validation=0.1, embedding_dim=8, hidden=(16,), out_dim=8)


def fresh(prep) -> RetrievalModel:
    torch.manual_seed(0)
    return RetrievalModel(prep.config)


def weights(model: RetrievalModel) -> dict[str, torch.Tensor]:
    return {
        k: v for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.startswith("index.")
    }  # fmt: skip


def scripted(values: list[float], calls: list[int]):
    """An evaluation that reports ``values`` in turn and records the epochs it saw."""

    def evaluate(model: RetrievalModel) -> dict[str, float]:
        assert not model.training
        calls.append(len(calls) + 1)
        return {"recall@10": values[len(calls) - 1]}

    return evaluate


def cfg(**kw) -> TrainConfig:
    return TrainConfig(batch_size=64, progress=False, **kw)


def test_patience_stops_and_the_best_epochs_weights_are_kept(prep):
    calls: list[int] = []
    model = fresh(prep)
    trainer = Trainer(
        model, prep.train, cfg(epochs=6), scripted([0.1, 0.3, 0.2, 0.3, 0.9, 0.9], calls),
        stopper=EarlyStopping("recall@10", patience=2),
    )  # fmt: skip
    trainer.fit()
    assert calls == [1, 2, 3, 4] and trainer.stopped and trainer.epoch == 4
    assert trainer.kept_epoch == 2
    two = fresh(prep)
    Trainer(two, prep.train, cfg(epochs=2)).fit()  # evaluating changes no weight
    torch.testing.assert_close(weights(model), weights(two), rtol=0, atol=0)
    four = fresh(prep)
    Trainer(four, prep.train, cfg(epochs=4)).fit()
    assert any(not torch.equal(weights(four)[k], v) for k, v in weights(model).items())


def test_a_failing_evaluation_keeps_its_epoch_and_a_resume_evaluates_it(prep, tmp_path):
    def broken(model: RetrievalModel) -> dict[str, float]:
        raise RuntimeError("evaluation broke")

    first = fresh(prep)
    c = cfg(epochs=3, checkpoint_dir=tmp_path)
    stopper = EarlyStopping("recall@10", patience=0)
    with pytest.raises(RuntimeError, match="evaluation broke"):
        Trainer(first, prep.train, c, broken, stopper=stopper).fit()
    saved = torch.load(tmp_path / CHECKPOINT_FILE, weights_only=True)
    assert saved["epoch"] == 1 and saved["evals"] == []  # trained, written, then evaluated

    calls: list[int] = []
    resumed_model = fresh(prep)
    resumed = Trainer(
        resumed_model, prep.train, c, scripted([0.5, 0.4, 0.6], calls),
        stopper=EarlyStopping("recall@10", patience=0),
    )  # fmt: skip
    resumed.resume(tmp_path / CHECKPOINT_FILE)
    resumed.fit()
    assert [e["epoch"] for e in resumed.evals] == [1.0, 2.0, 3.0]  # epoch 1 evaluated on resume
    assert resumed.kept_epoch == 3 and not resumed.stopped

    whole = fresh(prep)
    Trainer(whole, prep.train, cfg(epochs=3)).fit()
    torch.testing.assert_close(weights(resumed_model), weights(whole), rtol=0, atol=0)
