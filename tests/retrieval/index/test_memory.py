"""Memory defaults (issue 21): no exact copy unless re-rank is on, every reader of the vectors
correct without it, old indexes with a copy still load, re-rank in bounded chunks; row scales in
bfloat16 (old float32 ones load), any finite row's range kept."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.index import IVFConfig, IVFIndex, build_ivf, exact_search, recall_at_k
from retrieval.index.codes import dequantize, quantize
from retrieval.index.eligible_scan import eligible_positions
from retrieval.index.probe import rescore
from support.formats import unversioned


@pytest.fixture(scope="module")
def lean(catalog) -> IVFIndex:
    """The default copy; costs by the constant model, so which filtered rows scan exactly does
    not hinge on the build's timings (a loaded machine once measured lists as cheaper)."""
    return build_ivf(
        catalog["x"],
        IVFConfig(nlist=64, nprobe=8, measure_costs=False),
        item_attributes=catalog["attrs"],
        attribute_values=catalog["values"],
    )


def test_the_default_keeps_no_exact_copy(lean, catalog):
    assert lean.config.exact_copy == "none" and lean.exact.shape == (0, lean.dim)
    assert not lean.keeps_exact_copy
    per_item = sum(lean.memory_bytes().values()) / lean.ntotal
    with_copy = build_ivf(catalog["x"][:5000], IVFConfig(nlist=16, rerank=100))
    assert with_copy.config.exact_copy == "float16" and with_copy.exact.dtype == torch.float16
    # codes (D) + scale (2) + id (8) + the id -> row lookup (4) + signature words (8 each),
    # + centroids and postings
    words = lean.sig.shape[1]
    assert lean.memory_bytes()["id_order"] == 4 * lean.ntotal
    assert lean.memory_bytes()["scales"] == 2 * lean.ntotal and lean.scales.dtype == torch.bfloat16
    assert per_item < lean.dim + 2 + 8 + 4 + 8 * words + 16
    assert lean.memory_bytes()["exact"] == 0


def test_vectors_decode_from_the_codes(lean, catalog):
    pos = torch.arange(0, lean.ntotal, 97)
    got = lean.vectors_at(pos)  # [M, D]
    want = catalog["x"][lean.item_ids[pos]]
    err = (got - want).abs().max(dim=1).values
    assert float(err.max()) < 0.05 * float(want.abs().max())


def test_the_filtered_exact_plan_works_without_a_copy(lean, catalog):
    text = "shard = 3 and bucket in {1,2}"  # ~0.2 % of items: scanned exactly
    plan = lean.search_plan(10, text, batch=len(catalog["q"]))
    assert bool(plan.exact.all())
    ids, _ = lean.search(catalog["q"], 10, text)
    fb = lean.compile_filter(text, 1)
    ok = torch.zeros(lean.ntotal, dtype=torch.bool)
    ok[lean.item_ids[eligible_positions(lean.tensors(), fb.masks[0], fb.negate[0])]] = True
    assert ok[ids[ids >= 0]].all()
    truth, _ = exact_search(catalog["x"], catalog["q"], 10, eligible=ok)
    assert recall_at_k(ids, truth) >= 0.95  # decoded codes rank almost as the vectors do


def test_an_index_saved_with_a_copy_loads_into_a_default_config(catalog):
    old = build_ivf(catalog["x"][:5000], IVFConfig(nlist=16, exact_copy="float16"))
    buf = io.BytesIO()
    torch.save(old.state_dict(), buf)
    buf.seek(0)
    fresh = IVFIndex(IVFConfig(), old.dim)  # "auto" -> no copy, until the saved one arrives
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.config.exact_copy == "float16" and torch.equal(fresh.exact, old.exact)
    q = catalog["q"][:8]
    assert torch.equal(fresh.search(q, 20, rerank=50)[0], old.search(q, 20, rerank=50)[0])


def test_an_index_saved_with_float32_scales_loads_with_bfloat16_and_bounds_that_hold(lean, catalog):
    """An index saved before 2-byte scales: its float32 scales (here nudged off the bfloat16
    grid, as a float32 build made them) load rounded, and every list's radius still bounds the
    residuals the new scales decode to (the filtered plan's bound check relies on it)."""
    state = unversioned(lean.state_dict())
    state["scales"] = state["scales"].float() * (1 + 3e-3)  # off the grid, and larger
    fresh = IVFIndex(IVFConfig(), lean.dim)
    fresh.load_state_dict(state)
    assert fresh.scales.dtype == torch.bfloat16
    assert torch.equal(fresh.scales, state["scales"].bfloat16())
    norms = dequantize(fresh.codes, fresh.scales).norm(dim=1)
    sizes = (fresh.offsets[1:] - fresh.offsets[:-1]).tolist()
    for radius, part in zip(fresh.list_radius.tolist(), norms.split(sizes), strict=True):
        assert part.numel() == 0 or float(part.max()) <= radius
    assert (fresh.list_radius > lean.list_radius).any()  # the nudge widened some lists
    ids, _ = fresh.search(catalog["q"][:16], 10)
    assert recall_at_k(ids, lean.search(catalog["q"][:16], 10)[0]) >= 0.95


@pytest.mark.parametrize("codes", ["int8", "fp8"])
def test_rows_of_any_finite_range_decode_within_their_code_step(codes):
    """Scales keep float32's range: rows of 1e-30 and 1e30 (values a half could not scale)
    decode as closely as rows near 1, and an index of rows near 1e15 ranks as exact search."""
    x = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    x[:100] *= 1e-30
    x[100:200] *= 1e30
    packed, scales = quantize(x, codes)
    err = (dequantize(packed, scales) - x).abs().amax(dim=1) / x.abs().amax(dim=1)
    assert scales.dtype == torch.bfloat16 and float(err.max()) < (
        0.005 if codes == "int8" else 0.07
    )
    big = x[200:] * 1e15
    index = build_ivf(big, IVFConfig(nlist=4, codes=codes))
    truth, _ = exact_search(big, big[:20], 5)
    assert recall_at_k(index.search(big[:20], 5, nprobe=4)[0], truth) >= 0.9


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(0, 9),
    r=st.integers(1, 12),
    floats=st.sampled_from([1, 7, 50, 1 << 22]),
    half=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_rescore_in_chunks_equals_one_gather(b, r, floats, half, seed):
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(30, 5, generator=g).to(torch.float16 if half else torch.float32)
    q = torch.randn(b, 5, generator=g)
    cand = torch.randint(-1, 30, (b, r), generator=g)
    got = rescore(q, cand, exact, max_floats=floats)  # chunks of 1 row up to all rows
    want = torch.einsum("bd,brd->br", q, exact[cand.clamp(min=0)].float())
    want = want.masked_fill(cand < 0, float("-inf"))
    torch.testing.assert_close(got, want)
