"""Hard negatives mined from the model's own index: from the asked ranks, never the positive,
deterministic, and refused where they are not supported."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.training.config import TrainConfig
from retrieval.training.hard_negatives import HardNegativeMiner
from retrieval.training.pairs import batch_inputs
from retrieval.training.prepare import prepare
from retrieval.training.train import Trainer, _check_distributed


@pytest.fixture(scope="module")
def prep():
    return prepare(generate(SyntheticConfig(num_users=200, num_items=300, seed=3)), history_len=8)


def test_mined_items_come_from_the_asked_ranks_and_are_never_the_positive(prep) -> None:
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    miner = HardNegativeMiner(count=40, ranks=(5, 20), seed=0)
    assert (
        miner.mine(model, batch_inputs(model, prep.train, np.arange(4)), np.zeros(4), 0, 0).size
        == 0
    )
    miner.refresh(model, prep.train.item_features)
    idx = np.arange(64)
    batch = batch_inputs(model, prep.train, idx)
    positives = prep.train.item_ids[idx]
    got = miner.mine(model, batch, positives, epoch=1, step=0)
    assert 0 < len(got) <= 40
    assert np.array_equal(got, miner.mine(model, batch, positives, epoch=1, step=0))
    with torch.no_grad():
        q = model.user_vectors(batch)
    assert miner.index is not None
    ranked, _ = miner.index.search(q, 20)
    ranked_sets = [set(r[5:20].tolist()) for r in ranked]
    for item in got:  # each mined item sits at rank 5..19 of some row's result
        assert any(item in s for s in ranked_sets)

    only = np.full(64, int(got[0]))  # every row's positive is the first mined item
    assert int(got[0]) not in miner.mine(model, batch, only, epoch=1, step=0).tolist()


def test_a_run_with_hard_negatives_trains_and_is_deterministic(prep) -> None:
    states = []
    for _ in range(2):
        torch.manual_seed(0)
        model = RetrievalModel(prep.config)
        cfg = TrainConfig(
            epochs=2, batch_size=128, progress=False, hard_negatives=16, hard_negative_ranks=(2, 30)
        )
        trainer = Trainer(model, prep.train, cfg)
        losses = trainer.fit()
        assert all(np.isfinite(losses)) and trainer.miner is not None and trainer.miner.index
        states.append(model.state_dict())
    tensors = [k for k, v in states[0].items() if isinstance(v, torch.Tensor)]
    assert tensors and all(torch.equal(states[0][k], states[1][k]) for k in tensors)


def test_bad_ranks_and_torchrun_are_refused() -> None:
    with pytest.raises(ValueError, match="lo < hi"):
        HardNegativeMiner(4, (10, 10), 0)
    with pytest.raises(ValueError, match="hard_negatives"):
        _check_distributed(TrainConfig(hard_negatives=8, batch_size=128), world=2)
