"""The trained synthetic model that ``test_model.py`` and ``test_tiering.py`` both read (neither
changes it: a test that needs another copies it), trained once per run."""

from __future__ import annotations

import pytest

from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.training.prepare import Prepared, prepare
from retrieval.training.train import TrainConfig, train


@pytest.fixture(scope="session")
def trained_synthetic() -> tuple[Prepared, RetrievalModel, list[float]]:
    """800 users, 3,000 items, 3 epochs, the default index settings -> (prep, model in eval
    mode, the epochs' losses)."""
    ds = generate(SyntheticConfig(num_users=800, num_items=3000, seed=3))
    prep = prepare(ds, history_len=20)
    model = RetrievalModel(prep.config)
    losses = train(model, prep.train, TrainConfig(epochs=3, batch_size=256, progress=False))
    model.build_index(prep.train.item_features, ds.item_attributes, prep.tune_batch())
    return prep, model.eval(), losses
