"""Packed rows: every dtype round-trips within its bound and matches fbgemm's kernel bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharded_tables.quantize import pack_rows, quantization_bound, unpack_rows
from sharded_tables.specs import DType, TableSpec, row_bytes


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(DType)),
    n=st.integers(1, 20),
    half_dim=st.integers(1, 24),
    scale=st.sampled_from([1e-4, 0.05, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_within_bound(dtype: DType, n: int, half_dim: int, scale: float, seed: int):
    d = 2 * half_dim
    w = torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * scale
    packed = pack_rows(w, dtype)
    assert packed.dtype == torch.uint8 and packed.shape == (n, row_bytes(d, dtype))
    err = (unpack_rows(packed, dtype, d) - w).abs().amax(dim=1)
    assert (err <= quantization_bound(w, dtype)).all()


def test_constant_rows_and_extremes_are_exact():
    w = torch.tensor([[0.5] * 8, [-3.0] * 8, [0.0] * 8])
    for dtype in (DType.INT8, DType.INT4, DType.FP16, DType.FP32):
        assert torch.equal(unpack_rows(pack_rows(w, dtype), dtype, 8), w), dtype
    mn_mx = torch.tensor([[-1.0, 1.0, 0.25, -0.5]])
    got = unpack_rows(pack_rows(mn_mx, DType.INT8), DType.INT8, 4)
    assert got[0, 0] == -1.0 and abs(float(got[0, 1]) - 1.0) < 1e-3  # min stored exactly


def test_fp8_clips_instead_of_writing_nan():
    w = torch.tensor([[1000.0, -1000.0, 1.0, 0.0]])
    got = unpack_rows(pack_rows(w, DType.FP8), DType.FP8, 4)
    assert torch.isfinite(got).all() and got[0, 0] == 448.0 and got[0, 1] == -448.0


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="NaN"):
        pack_rows(torch.tensor([[float("nan"), 0.0]]), DType.INT8)
    with pytest.raises(ValueError, match="even dim"):
        pack_rows(torch.zeros(2, 3), DType.INT4)
    with pytest.raises(ValueError, match="65504"):
        pack_rows(torch.full((1, 2), 1e6), DType.FP16)
    with pytest.raises(ValueError, match="expected uint8"):
        unpack_rows(torch.zeros(2, 5, dtype=torch.uint8), DType.INT8, 4)


def test_table_spec_sizes_and_validation():
    spec = TableSpec("user_id", rows=10_000_000, dim=64, dtype=DType.INT8)
    assert spec.bytes() == 680_000_000 and spec.row_bytes(DType.INT4) == 36
    assert TableSpec("t", 1, 4, dtype="fp16", allowed_dtypes=("int4",)).dtypes() == (
        DType.FP16,
        DType.INT4,
    )
    with pytest.raises(ValueError, match="'t': int4 rows need an even dim"):
        TableSpec("t", 1, 3, allowed_dtypes=(DType.INT4,))
    with pytest.raises(ValueError, match="pooling"):
        TableSpec("t", 1, 4, pooling="max")
