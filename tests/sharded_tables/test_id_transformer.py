"""IdTransformer admission / eviction, its sketch, and fresh rows of hashed tables (their
round trip through the embedding servers: test_hashed_training.py)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharded_tables.hashed_training import hashed_uniform
from sharded_tables.id_transformer import AdmissionSketch, IdTransformer


def _t(keys: list[int]) -> torch.Tensor:
    return torch.tensor(keys, dtype=torch.int64)


def test_admission_after_k_sightings():
    t = IdTransformer(4, admit_after=3)
    assert t.transform(_t([7, 9])).rows.tolist() == [-1, -1]
    r = t.transform(_t([7, 7, 9]))  # 7 seen 3 times, 9 twice
    assert r.rows.tolist() == [0, 0, -1]
    assert (r.admitted_ids.tolist(), r.admitted_rows.tolist()) == ([7], [0])
    r = t.transform(_t([9, 7]))
    assert r.rows.tolist() == [1, 0] and r.admitted_ids.tolist() == [9]


def test_eviction_reports_ids_and_rows():
    t = IdTransformer(2, policy="lru")
    t.transform(_t([1, 2]))
    t.transform(_t([2]))
    r = t.transform(_t([3, 2]))
    assert r.rows.tolist() == [0, 1]
    assert (r.evicted_ids.tolist(), r.evicted_rows.tolist()) == ([1], [0])
    assert (r.admitted_ids.tolist(), r.admitted_rows.tolist()) == ([3], [0])


def test_batch_wider_than_capacity_admits_what_fits():
    t = IdTransformer(2)
    t.transform(_t([5]))
    r = t.transform(_t([9, 5, 8, 7]))  # 5 stays; one new id fits: the smallest, 7
    assert r.rows.tolist() == [-1, 0, -1, 1]
    assert IdTransformer(0).transform(_t([1, 2])).rows.tolist() == [-1, -1]


def test_fresh_rows_are_a_pure_function_of_seed_and_id():
    a = hashed_uniform(_t([2**62, 3]), 4, 0.1, seed=3)
    b = hashed_uniform(_t([3, 2**62]), 4, 0.1, seed=3)
    assert torch.equal(a, b.flip(0))  # not of batch order
    assert a.abs().max() <= 0.1 and a.std() > 0.01
    assert not torch.equal(hashed_uniform(_t([3]), 4, 0.1, seed=4), a[1:])


def test_state_round_trip():
    t = IdTransformer(3, admit_after=2)
    t.transform(_t([1, 1, 2, 3, 3]))
    u = IdTransformer(3, admit_after=2)
    u.load_state_dict(t.state_dict())
    assert u.transform(_t([2, 1])).rows.tolist() == t.transform(_t([2, 1])).rows.tolist()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 20), max_size=60))
def test_sketch_never_undercounts_between_halvings(ids):
    sketch = AdmissionSketch(width=16)  # halves after 160 sightings: not within 60
    seen: dict[int, int] = {}
    for k in ids:
        seen[k] = seen.get(k, 0) + 1
        assert int(sketch.add(_t([k]))[0]) >= seen[k]


def _numpy_sketch_add(counts: np.ndarray, coef: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The sketch's definition in NumPy: buckets ``(a lo + b hi + c) mod p mod width`` per row,
    every sighting added (``np.add.at``) before the estimates (row minimum) are read."""
    p = (1 << 31) - 1
    lo, hi = ids & 0xFFFFFFFF, (ids >> 32) & 0xFFFFFFFF
    a, b, c = coef
    at = ((lo * a) % p + (hi * b) % p + c) % p % counts.shape[1]  # [depth, n]
    at += np.arange(counts.shape[0])[:, None] * counts.shape[1]
    flat = counts.reshape(-1)
    np.add.at(flat, at.reshape(-1), 1)
    return flat[at].min(axis=0).astype(np.int64)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 40), max_size=40),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 64),
    st.integers(0, 2**16),
)
def test_sketch_counts_as_its_numpy_definition(batches, width, seed):
    """The C++ update gives the estimates and counters of the NumPy definition on every batch
    (repeats and far-apart 64-bit ids included; no halving within these batches)."""
    sketch = AdmissionSketch(width, seed=seed)
    counts = np.zeros((4, width), np.int32)
    for ids in batches:
        if sketch.sightings + len(ids) >= sketch.reset_after:
            break
        got = sketch.add(_t(ids))
        want = _numpy_sketch_add(counts, sketch.coef.numpy(), np.array(ids, np.int64))
        assert got.tolist() == want.tolist()
        assert np.array_equal(sketch.counts.numpy(), counts)


def test_sketch_ages_by_halving():
    sketch = AdmissionSketch(width=1, depth=1)
    assert sketch.add(_t([1] * 9)).tolist() == [9] * 9
    assert sketch.add(_t([2])).tolist() == [10]  # 10 sightings: counters halve afterwards
    assert sketch.add(_t([3])).tolist() == [6]
