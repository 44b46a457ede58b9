"""Checks against the data, before the first step: K against the catalog, splits that hold out
nothing, and epochs of a handful of steps."""

from __future__ import annotations

import logging

import pytest

from retrieval.training.checks import FEW_STEPS, check_run, epoch_plan
from retrieval.training.config import RunConfig
from retrieval.training.prepare import prepare
from support.split_data import tiny


def config(**evaluate: float) -> RunConfig:
    return RunConfig.from_dict({"train": {"batch_size": 4}, "evaluate": {"k": 10, **evaluate}})


def test_k_larger_than_the_catalog_is_refused_naming_evaluate_k():
    prep = prepare(tiny(num_items=80), history_len=10)
    with pytest.raises(
        ValueError, match=r"^evaluate\.k: 100 is larger than the catalog \(80 items\)"
    ):
        check_run(config(k=100, validation=0), prep)
    check_run(config(k=80, validation=0), prep)  # the whole catalog is a valid K


def test_no_test_user_is_refused_saying_why():
    prep = prepare(tiny(counts=(1, 1, 1, 0)), history_len=10)
    with pytest.raises(ValueError, match=r"no user has a test interaction.*3 users have a single"):
        check_run(config(validation=0), prep)


def test_a_validation_split_that_holds_out_nothing_is_refused_naming_it():
    prep = prepare(tiny(counts=(2, 2, 1)), history_len=10, validation=0.1)
    with pytest.raises(ValueError, match=r"^evaluate\.validation: 0\.1 holds out no interaction"):
        check_run(config(validation=0.1), prep)


def test_a_handful_of_steps_per_epoch_is_warned_about_once(caplog):
    prep = prepare(tiny(), history_len=10)  # 14 training pairs
    with caplog.at_level(logging.WARNING, logger="retrieval.training.checks"):
        plan = check_run(config(validation=0), prep)
    assert (plan.pairs, plan.batch_size, plan.steps, plan.unused_pairs) == (14, 4, 3, 2)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("train.batch_size = 4 against 14 training pairs is 3 steps per epoch")


def test_enough_steps_are_not_warned_about(caplog):
    prep = prepare(tiny(counts=(60, 60)), history_len=10)
    cfg = RunConfig.from_dict({"train": {"batch_size": 8}, "evaluate": {"k": 10, "validation": 0}})
    with caplog.at_level(logging.WARNING, logger="retrieval.training.checks"):
        assert check_run(cfg, prep).steps >= FEW_STEPS
    assert not caplog.records


@pytest.mark.parametrize(
    ("pairs", "batch", "steps", "unused"),
    [(0, 8, 0, 0), (5, 8, 1, 0), (16, 8, 2, 0), (17, 8, 2, 1)],
)
def test_epoch_plan(pairs, batch, steps, unused):
    plan = epoch_plan(pairs, batch)
    assert (plan.steps, plan.unused_pairs) == (steps, unused)
