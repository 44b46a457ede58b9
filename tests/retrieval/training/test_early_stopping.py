"""The early-stopping policy alone: best epoch, patience, ties, NaN, state round trip."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrieval.training.early_stopping import EarlyStopping


def feed(stopper: EarlyStopping, values: list[float]) -> int:
    """Feeds epochs 1, 2, ... until it says stop; -> the last epoch fed."""
    for epoch, value in enumerate(values, start=1):
        stopper.update(epoch, value)
        if stopper.should_stop:
            return epoch
    return len(values)


def test_the_docstring_example():
    stopper = EarlyStopping("recall@100", patience=2)
    assert feed(stopper, [0.20, 0.25, 0.24, 0.25, 0.9]) == 4  # a tie is no improvement
    assert (stopper.best_epoch, stopper.best_value, stopper.bad_epochs) == (2, 0.25, 2)


def test_patience_zero_never_stops_but_still_tracks_the_best():
    stopper = EarlyStopping("recall@10", patience=0)
    assert feed(stopper, [0.3, 0.2, 0.1, 0.0]) == 4
    assert stopper.best_epoch == 1 and not stopper.should_stop


def test_nan_never_improves():
    stopper = EarlyStopping("recall@10", patience=1)
    assert not stopper.update(1, math.nan)
    assert stopper.best_epoch == 0 and stopper.should_stop


def test_a_negative_patience_is_refused_naming_it():
    with pytest.raises(ValueError, match="patience: must be >= 0, got -1"):
        EarlyStopping("recall@10", patience=-1)


@given(
    values=st.lists(st.floats(0, 1), min_size=1, max_size=12),
    patience=st.integers(0, 4),
)
def test_best_is_the_first_maximum_before_the_stop(values, patience):
    stopper = EarlyStopping("recall@10", patience)
    last = feed(stopper, values)
    seen = values[:last]
    assert stopper.best_value == max(seen)
    assert stopper.best_epoch == seen.index(max(seen)) + 1
    assert stopper.bad_epochs == last - stopper.best_epoch
    if patience and last < len(values):
        assert stopper.bad_epochs == patience
    assert EarlyStopping.from_state(stopper.state()) == stopper
