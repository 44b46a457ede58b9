"""Per-task labels from task names, and the head's per-task loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrieval.data import Interactions
from retrieval.training.loss import task_loss
from retrieval.training.task_labels import task_labels


def _events(values: list[float] | None) -> Interactions:
    m = 4 if values is None else len(values)
    ids = np.arange(m, dtype=np.int64)
    return Interactions(ids, ids, ids, None if values is None else np.array(values, np.float32))


def test_labels_follow_the_task_names() -> None:
    got = task_labels(["engagement", "value>=4", "value > 4.5"], _events([3, 4, 5, 4.5]))
    assert got.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]]
    assert got.dtype == np.float32


def test_unknown_rules_and_missing_values_are_named() -> None:
    with pytest.raises(ValueError, match="'value=>4' is not a label rule"):
        task_labels(["value=>4"], _events([1.0]))
    assert np.isnan(task_labels(["click"], _events([1.0]))).all()  # softmax only, as before
    with pytest.raises(ValueError, match="'value>=4' reads the interactions' value"):
        task_labels(["value>=4"], _events(None))


def test_values_must_be_one_float_per_event() -> None:
    ev = _events([1.0, 2.0])
    ev.value = np.array([1, 2])  # ints
    with pytest.raises(ValueError, match=r"interactions\.value"):
        ev.validate()
    assert _events([1.0, 2.0, 3.0]).select(np.array([2, 0])).value.tolist() == [3.0, 1.0]


def test_a_task_without_labels_is_left_out_of_the_loss() -> None:
    logits = torch.zeros(2, 2, 2, requires_grad=True)
    labels = torch.tensor([[1.0, float("nan")], [0.0, float("nan")]])
    loss = task_loss(logits, labels, torch.tensor([3, 4]), torch.tensor([3, 4]))
    loss.backward()
    assert torch.isfinite(loss) and (logits.grad[..., 1] == 0).all()
    assert (logits.grad[..., 0] != 0).all()


def test_task_loss_labels_own_column_and_leaves_out_repeats() -> None:
    # rows 0 and 1 share item 7: column 1 is left out of row 0's loss, column 0 of row 1's
    logits = torch.zeros(2, 3, 1, requires_grad=True)
    labels = torch.tensor([[1.0], [0.0]])
    loss = task_loss(logits, labels, torch.tensor([7, 7]), torch.tensor([7, 7, 9]))
    loss.backward()
    g = logits.grad[:, :, 0]
    assert g[0, 1] == 0 and g[1, 0] == 0  # repeats: no gradient
    assert g[0, 0] < 0 and g[1, 1] > 0 and g[0, 2] > 0  # positive up, negatives down
    assert torch.isclose(loss, torch.tensor(np.log(2.0), dtype=torch.float32))


def test_prepare_labels_the_pairs_and_the_head_trains_on_them() -> None:
    from retrieval.data import SyntheticConfig, generate
    from retrieval.model import RetrievalModel
    from retrieval.training.config import TrainConfig
    from retrieval.training.prepare import prepare
    from retrieval.training.train import Trainer

    ds = generate(SyntheticConfig(num_users=100, num_items=120, seed=1))
    with pytest.raises(ValueError, match="this data has none"):
        prepare(ds, scoring_head=True, head_tasks=("value>=4",), head_task_weights=(1.0,))
    it = ds.interactions
    ds.interactions = Interactions(
        it.user_id, it.item_id, it.timestamp, (it.item_id % 5 + 1).astype(np.float32)
    )
    prep = prepare(
        ds, history_len=6, scoring_head=True, head_tasks=("engagement", "value>=4"),
        head_task_weights=(1.0, 0.5),
    )  # fmt: skip
    labels = prep.train.task_labels
    assert labels is not None and labels.shape == (len(prep.train.item_ids), 2)
    assert np.array_equal(labels[:, 1], (prep.train.item_ids % 5 + 1 >= 4).astype(np.float32))
    losses = {}
    for weight in (0.0, 1.0):
        torch.manual_seed(0)
        model = RetrievalModel(prep.config)
        cfg = TrainConfig(epochs=1, batch_size=64, progress=False, task_loss_weight=weight)
        losses[weight] = Trainer(model, prep.train, cfg).fit()[0]
    assert np.isfinite(losses[1.0]) and losses[1.0] > losses[0.0]  # the BCE term is added
