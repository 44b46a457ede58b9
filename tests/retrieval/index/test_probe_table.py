"""The probe's int8 table (``scan.probe_table_cpu``): a few queries' probe that reads it first
and scores exactly only the lists near its best gives the float probe's lists and coarse scores,
bit for bit, ties included (equal centroids: the lower list first), on the VNNI path and on the
AVX2 one (a 7-bit query); a path this CPU cannot run is skipped."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.index.probe import half_sq_norms
from retrieval.index.scan import _extension, probe_table_cpu
from support.isa import SIMD, force, forced


@pytest.mark.parametrize("isa", SIMD)
@settings(max_examples=60, deadline=None)
@given(
    nlist=st.integers(1, 300),
    d=st.integers(1, 200),
    b=st.integers(1, 16),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    l2=st.booleans(),
    tie=st.booleans(),
    share=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_the_table_gives_the_float_probe_bit_for_bit(isa, nlist, d, b, scale, l2, tie, share, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(nlist, d, generator=g) * scale
    if tie and nlist > 2:
        c[nlist - 1] = c[1]  # two lists with the same key for every query
    ct = c.T.contiguous()
    half = half_sq_norms(c).contiguous() if l2 else torch.zeros(0)
    q = torch.randn(b, d, generator=g) * 3
    p = max(1, round(share * nlist))
    ext = _extension()
    want = ext.ivf_probe(q, ct, half, p)
    with forced(isa):
        got = ext.ivf_probe(q, ct, half, p, probe_table_cpu(ct))
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    if tie and nlist > 2:  # equal keys: the lower list first, on either path
        for row in want[1].tolist():
            if 1 in row and nlist - 1 in row:
                assert row.index(1) < row.index(nlist - 1)


@pytest.mark.parametrize("isa", SIMD)
def test_a_table_of_other_centroids_is_refused_and_non_finite_values_take_the_floats(
    isa, monkeypatch
):
    force(monkeypatch, isa)
    c = torch.randn(40, 24)
    ct = c.T.contiguous()
    ext = _extension()
    other = probe_table_cpu(torch.randn(24, 80))  # other sizes: refused (contents are not checked)
    with pytest.raises(
        RuntimeError, match=r"table: not probe_table\(centroids_t\) of these centroids"
    ):
        ext.ivf_probe(torch.randn(2, 24), ct, torch.zeros(0), 4, other)
    q = torch.randn(2, 24)
    q[1, 3] = float("nan")
    want = ext.ivf_probe(q, ct, torch.zeros(0), 4)
    got = ext.ivf_probe(q, ct, torch.zeros(0), 4, probe_table_cpu(ct))
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0][0], want[0][0])
    c[5, 7] = float("inf")  # a centroid not finite: its table says so and is never read
    ct = c.T.contiguous()
    table = probe_table_cpu(ct)
    assert not bool(table[2])
    q = torch.randn(3, 24)
    torch.testing.assert_close(
        ext.ivf_probe(q, ct, torch.zeros(0), 4, table), ext.ivf_probe(q, ct, torch.zeros(0), 4)
    )
