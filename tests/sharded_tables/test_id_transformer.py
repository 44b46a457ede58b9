"""IdTransformer admission / eviction and TransformedTable's round trip through a RowStore."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharded_tables.dynamic_table import TransformedTable, hashed_uniform
from sharded_tables.id_transformer import AdmissionSketch, IdTransformer
from sharded_tables.quantize import pack_rows, unpack_rows
from sharded_tables.specs import DType, row_bytes
from sharded_tables.store import MemoryRowStore


def _t(keys: list[int]) -> torch.Tensor:
    return torch.tensor(keys, dtype=torch.int64)


def _table(capacity: int, dim: int = 4, dtype: DType = DType.FP32, **kw) -> TransformedTable:
    store = MemoryRowStore({"t": row_bytes(dim, dtype)})
    return TransformedTable("t", capacity, dim, store, dtype=dtype, **kw)


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


def test_evicted_rows_come_back_bit_identical():
    table = _table(capacity=3, dim=4)
    ids = [11, 2**40 + 1, -5]
    table.lookup(_t(ids))
    learned = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    learned[0, 0] = float.fromhex("0x1.000002p-126")  # a low-bit pattern fp16 would lose
    table.weight[table.transformer.map.find(_t(ids), record=False)] = learned
    table.lookup(_t([100, 101, 102]))  # evicts all three
    assert not table.lookup(_t([100])).isnan().any()
    back = table.lookup(_t(ids))  # re-admitted from the store
    assert torch.equal(back.view(torch.int32), learned.view(torch.int32))


def test_unseen_ids_get_zero_or_seeded_rows_without_rebuild():
    table = _table(capacity=8, dim=4)
    assert torch.equal(table.lookup(_t([2**62, 3])), torch.zeros(2, 4))
    seeded = _table(capacity=8, dim=4, init_scale=0.1, seed=3)
    a = seeded.lookup(_t([2**62, 3]))
    b = _table(capacity=8, dim=4, init_scale=0.1, seed=3).lookup(_t([3, 2**62]))
    assert torch.equal(a, b.flip(0))  # a pure function of (seed, id), not of batch order
    assert a.abs().max() <= 0.1 and a.std() > 0.01
    assert not torch.equal(hashed_uniform(_t([3]), 4, 0.1, seed=4), a[1:])


def test_not_admitted_ids_read_zero_rows():
    table = _table(capacity=4, admit_after=2, init_scale=1.0)
    assert torch.equal(table.lookup(_t([1])), torch.zeros(1, 4))
    assert table.lookup(_t([1])).abs().sum() > 0


def test_quantized_store_round_trip_and_flush():
    table = _table(capacity=2, dim=4, dtype=DType.INT8)
    table.lookup(_t([1, 2]))
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0], [4.0, 4.0, 4.0, 4.0]])
    table.weight.copy_(w)
    table.flush()
    packed, found = table.store.get("t", _t([1, 2]))
    assert found.all() and torch.equal(packed, pack_rows(w, DType.INT8))
    table.lookup(_t([3, 4]))
    back = table.lookup(_t([1, 2]))  # int8 in the store: equal up to the format's rounding
    assert torch.equal(back, unpack_rows(pack_rows(w, DType.INT8), DType.INT8, 4))


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


def test_sketch_ages_by_halving():
    sketch = AdmissionSketch(width=1, depth=1)
    assert sketch.add(_t([1] * 9)).tolist() == [9] * 9
    assert sketch.add(_t([2])).tolist() == [10]  # 10 sightings: counters halve afterwards
    assert sketch.add(_t([3])).tolist() == [6]
