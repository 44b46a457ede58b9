"""LocalTables: one fbgemm TBE call over mixed-dtype tables equals pooling the unpacked rows."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharded_tables.quantize import pack_rows, quantization_bound, unpack_rows
from sharded_tables.specs import DType
from sharded_tables.tbe import LocalTable, LocalTables, jagged_from_padded

TABLES = [
    LocalTable("item", 200, 16, DType.INT8, ("history", "item_id")),
    LocalTable("country", 40, 8, DType.INT4, ("country",), pooling="sum"),
    LocalTable("genre", 30, 8, DType.FP8, ("genre",)),
    LocalTable("age", 20, 4, DType.FP16, ("age",)),
    LocalTable("dense", 10, 4, DType.FP32, ("dense",)),
]
LENGTHS = {"history": 6, "item_id": 1, "country": 3, "genre": 2, "age": 1, "dense": 2}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.rows, t.dim, generator=g) * 0.1 for t in TABLES}


def _reference(features, weights, dequantize: bool) -> torch.Tensor:
    """Plain-torch pooling of (de)quantized rows, feature by feature."""
    outs = []
    for f, ids in features.items():
        t = next(t for t in TABLES if f in t.features)
        w = weights[t.name]
        if dequantize:
            w = unpack_rows(pack_rows(w, t.dtype), t.dtype, t.dim)
        present = ids >= 0
        pooled = (w[ids.clamp(min=0)] * present[..., None]).sum(dim=1)
        if t.pooling == "mean":
            pooled = pooled / present.sum(dim=1, keepdim=True).clamp(min=1)
        outs.append(pooled)
    return torch.cat(outs, dim=1)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 9), seed=st.integers(0, 2**16), backend=st.sampled_from(["fbgemm", "torch"])
)
def test_pooled_output_matches_unpacked_rows_and_fp32_within_bound(b: int, seed: int, backend: str):
    weights = _weights(seed)
    tables = LocalTables(TABLES, backend=backend)
    for name, w in weights.items():
        tables.set_float(name, w)
    g = torch.Generator().manual_seed(seed + 1)
    features = {}
    for f in tables.feature_names:
        rows = next(t.rows for t in TABLES if f in t.features)
        features[f] = torch.randint(-1, rows, (b, LENGTHS[f]), generator=g)  # -1 = padding
    indices, offsets, _ = jagged_from_padded(list(features.values()))
    out = tables(indices, offsets)
    assert out.shape == (b, sum(tables.feature_dims))
    # the padded fast path (the kernel skips -1 ids) equals the jagged call
    torch.testing.assert_close(tables.forward_padded(list(features.values())), out)
    no_fp8 = LocalTables([t for t in TABLES if t.dtype is not DType.FP8], backend=backend)
    for t in no_fp8.tables:
        no_fp8.set_float(t.name, weights[t.name])
    sub = [features[f] for f in no_fp8.feature_names]
    torch.testing.assert_close(
        no_fp8.forward_padded(sub), no_fp8(*jagged_from_padded(sub)[:2]), rtol=0, atol=0
    )
    # bit-for-bit what pooling the stored rows gives (kernel layout == our packing)
    torch.testing.assert_close(out, _reference(features, weights, True), rtol=1e-5, atol=1e-6)
    # and vs FP32: a pooled value is off by at most the per-row bound (mean of bounded errors;
    # a sum of L rows by L times it)
    fp32 = _reference(features, weights, False)
    col = 0
    for f, ids in features.items():
        t = next(t for t in TABLES if f in t.features)
        bound = quantization_bound(weights[t.name], t.dtype).max()
        scale = ids.shape[1] if t.pooling == "sum" else 1
        assert (out[:, col : col + t.dim] - fp32[:, col : col + t.dim]).abs().max() <= bound * scale
        col += t.dim


def test_packed_rows_round_trip_through_the_kernel_storage():
    tables = LocalTables(TABLES)
    w = _weights(3)
    for name in w:
        tables.set_float(name, w[name])
        t = next(t for t in TABLES if t.name == name)
        assert torch.equal(tables.packed(name), pack_rows(w[name], t.dtype))
    assert tables.bytes() == 200 * 20 + 40 * 8 + 30 * 8 + 20 * 8 + 10 * 16


def test_torch_backend_single_store_jagged_path_equals_the_kernel():
    same = [
        LocalTable("u", 50, 8, DType.INT8, ("u1", "u2")),
        LocalTable("v", 30, 8, DType.INT8, ("v",), pooling="sum"),
    ]
    kernel, torch_path = LocalTables(same), LocalTables(same, backend="torch")
    for t in same:
        w = torch.randn(t.rows, t.dim, generator=torch.Generator().manual_seed(t.rows))
        kernel.set_float(t.name, w)
        torch_path.set_float(t.name, w)
    g = torch.Generator().manual_seed(9)
    feats = [torch.randint(-1, rows, (6, 4), generator=g) for rows in (50, 50, 30)]
    indices, offsets, _ = jagged_from_padded(feats)
    torch.testing.assert_close(torch_path(indices, offsets), kernel(indices, offsets))
    torch.testing.assert_close(torch_path.forward_padded(feats), kernel.forward_padded(feats))
