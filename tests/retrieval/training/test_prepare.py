"""The time split into train, validation and test: who is held out, who is kept out (counted,
never silently), and which history the towers read."""

from __future__ import annotations

import numpy as np

from retrieval.training.prepare import SplitCounts, prepare
from support.split_data import tiny


def test_users_kept_out_of_each_split_are_counted():
    prep = prepare(tiny(), history_len=10, validation=0.25)
    assert prep.counts == SplitCounts(
        users=5,
        users_without_interactions=1,  # user 3
        users_in_test=3,  # users 1, 2, 4
        users_kept_out_of_test=1,  # user 0: a single interaction stays in training
        users_in_validation=2,  # users 1, 4 (user 2's training part is one interaction)
        users_kept_out_of_validation=2,  # users 0, 2
        train_pairs=1 + 6 + 1 + 3,
        validation_pairs=2 + 1,
        test_pairs=2 + 1 + 1,
    )
    assert prep.test_items[1] == {18, 19} and prep.validation_items[1] == {16, 17}
    assert prep.validation_items[4] == {43} and prep.test_items[4] == {44}
    assert prep.test_items[0] == set() == prep.validation_items[0]


def test_validation_items_are_neither_trained_on_nor_in_the_training_history():
    prep = prepare(tiny(), history_len=10, validation=0.25)
    pairs = set(zip(prep.train.user_ids.tolist(), prep.train.item_ids.tolist(), strict=True))
    held = {(u, i) for u in range(5) for i in prep.validation_items[u] | prep.test_items[u]}
    assert not pairs & held
    assert set(prep.train.history[1][prep.train.history[1] >= 0]) == set(range(10, 16))
    # evaluating the test split (and serving) the tower reads validation items too, newest first
    assert prep.history[1][:3].tolist() == [17, 16, 15]


def test_without_validation_the_split_is_train_and_test():
    ds = tiny()
    prep = prepare(ds, history_len=10)
    assert prep.counts is not None
    assert prep.counts.validation_pairs == 0 and prep.counts.users_kept_out_of_validation == 0
    assert prep.counts.train_pairs + prep.counts.test_pairs == len(ds.interactions)
    assert all(not s for s in prep.validation_items)
    np.testing.assert_array_equal(prep.train.history, prep.history)
