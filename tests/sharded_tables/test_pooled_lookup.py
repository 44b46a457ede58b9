"""The fused inference lookup (``pooled_lookup``) equals the collection's training path
(``nn.EmbeddingBag`` with per-sample weights) bit for bit; the collection uses it only without
gradients (that gradients still reach the rows: ``test_collection.py``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharded_tables import EmbeddingCollection, TableConfig
from sharded_tables.pooled_lookup import pool_cached, pooled_lookup
from sharded_tables.quantize import pack_rows, unpack_rows
from sharded_tables.specs import DType


def _collection(rows: int, dim: int, seed: int = 0) -> EmbeddingCollection:
    torch.manual_seed(seed)
    return EmbeddingCollection(
        [
            TableConfig("item", rows, dim, features=("history", "item_id")),
            TableConfig("country", 7, dim, pooling="sum"),
        ]
    )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    b=st.integers(1, 40),
    hist_len=st.integers(1, 30),
    dim=st.sampled_from([1, 3, 16, 64]),
    pad_share=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_fused_path_equals_the_training_path_exactly(b, hist_len, dim, pad_share, seed):
    tables = _collection(50, dim, seed)
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 50, (b, hist_len), generator=g)
    history[torch.rand(b, hist_len, generator=g) < pad_share] = -1  # some rows all padding
    features = {
        "history": history,
        "item_id": torch.randint(-1, 50, (b, 1), generator=g),
        "country": torch.randint(-1, 7, (b, 2), generator=g),
    }
    trained = tables(features)  # gradients on: nn.EmbeddingBag
    with torch.inference_mode():
        fused = tables(features)
    for name in features:
        assert trained[name].requires_grad  # the nn.EmbeddingBag path ran
        assert torch.equal(fused[name], trained[name].detach()), name


def test_empty_rows_are_zero_and_mean_divides_by_present_ids():
    w = torch.arange(12, dtype=torch.float32).view(4, 3)
    mean, total = pooled_lookup(
        [w, w], [torch.tensor([[1, 3, -1], [-1, -1, -1]]), torch.tensor([[2, 2]])], [True, False]
    )
    torch.testing.assert_close(mean[0], (w[1] + w[3]) / 2)
    assert torch.all(mean[1] == 0)
    torch.testing.assert_close(total[0], 2 * w[2])


@pytest.mark.parametrize("bad", [4, -2])
def test_an_id_out_of_range_is_refused(bad):
    with pytest.raises(RuntimeError, match=f"id {bad} is out of range for a table of 4 rows"):
        pooled_lookup([torch.zeros(4, 2)], [torch.tensor([[0, bad]])], [True])


def test_non_contiguous_ids_and_large_batches_use_every_row():
    w = torch.randn(100, 8)
    ids = torch.randint(0, 100, (3, 1000)).T  # [1000, 3], not contiguous
    (out,) = pooled_lookup([w], [ids], [False])
    torch.testing.assert_close(out, w[ids].sum(dim=1))


def test_the_fused_op_traces_under_torch_compile():
    tables = _collection(20, 4)
    features = {"history": torch.tensor([[1, 2, -1], [3, -1, -1]])}
    with torch.inference_mode():
        eager = tables(features)["history"]
    compiled = torch.compile(lambda f: tables(f)["history"], backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(features), eager)


# ---- pool_cached: pooling over a hot-row cache's packed rows -----------------------------------
def _cache_case(dtype: DType, dim: int, b: int, widths: list[int], seed: int):
    """A cache of 16 slots and a batch whose distinct ids are partly cached, partly fetched."""
    g = torch.Generator().manual_seed(seed)
    packed = pack_rows(torch.randn(50, dim, generator=g) * 3, dtype)  # the table's rows
    ids = torch.cat([torch.randint(-1, 50, (b * w,), generator=g) for w in widths])
    keys, positions = torch.unique(ids[ids != -1], return_inverse=True)
    full_positions = torch.zeros(len(ids), dtype=torch.int64)
    full_positions[ids != -1] = positions
    cached = torch.rand(len(keys), generator=g) < 0.5
    cached &= cached.cumsum(0) <= 16  # as many as the slots
    slots = torch.full((len(keys),), -1, dtype=torch.int64)
    slots[cached] = torch.randperm(16, generator=g)[: int(cached.sum())]
    storage = torch.zeros(16, packed.shape[1], dtype=torch.uint8)
    storage[slots[cached]] = packed[keys[cached]]
    return packed, ids, full_positions, slots, storage, packed[keys[~cached]]


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("mean", [True, False])
def test_pool_cached_decodes_every_dtype_and_pools_like_the_reference(dtype, mean):
    dim, b, widths = 8, 3, [5, 1, 4]
    for seed in range(4):
        packed, ids, positions, slots, storage, fetched = _cache_case(dtype, dim, b, widths, seed)
        got = pool_cached(storage, slots, fetched, ids, positions, widths, b, mean, dtype, dim)
        dense = unpack_rows(packed, dtype, dim)  # [50, dim]
        at = 0
        for w, out in zip(widths, got, strict=True):
            bag = ids[at : at + b * w].view(b, w)
            present = (bag != -1).float()
            want = (dense[bag.clamp(min=0)] * present[..., None]).sum(1)
            if mean:
                want = want / present.sum(1, keepdim=True).clamp(min=1)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            at += b * w


def test_pool_cached_fp32_equals_pooled_lookup_bit_for_bit():
    """fp32 rows pool exactly as the all-local path's kernel does (same sums, same order)."""
    dim, b, widths = 16, 4, [7, 2]
    packed, ids, positions, slots, storage, fetched = _cache_case(DType.FP32, dim, b, widths, 1)
    got = pool_cached(storage, slots, fetched, ids, positions, widths, b, True, DType.FP32, dim)
    weight = unpack_rows(packed, DType.FP32, dim)
    want = pooled_lookup(
        [weight, weight], [ids[: b * 7].view(b, 7), ids[b * 7 :].view(b, 2)], [True, True]
    )
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_pool_cached_refuses_sources_out_of_range():
    dim, b, widths = 4, 2, [3]
    packed, ids, positions, slots, storage, fetched = _cache_case(DType.FP32, dim, b, widths, 2)
    args = (ids, positions, widths, b, True, DType.FP32, dim)
    bad_slots = slots.clone()
    bad_slots[0] = 16
    with pytest.raises(RuntimeError, match="outside the cache"):
        pool_cached(storage, bad_slots, fetched, *args)
    with pytest.raises(RuntimeError, match="misses"):
        pool_cached(
            storage, slots, torch.cat([fetched, fetched[:1]]) if len(fetched) else packed[:1], *args
        )
    bad_positions = positions.clone()
    bad_positions[ids != -1] = len(slots)
    with pytest.raises(RuntimeError, match="outside the"):
        pool_cached(storage, slots, fetched, ids, bad_positions, widths, b, True, DType.FP32, dim)
