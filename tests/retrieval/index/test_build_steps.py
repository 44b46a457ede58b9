"""The build's one-pass steps answer what the torch ops they replaced answer: the int8 residual
codes (``scan.encode_int8_cpu``) and the slack read off the scan's scores
(``bound.measure_slack``). The bit counts and postings (``build.bit_index``) are checked against
a bit-by-bit build in ``tests/retrieval/test_filters.py``."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.index import IVFConfig, build_ivf
from retrieval.index.bound import as_scored, measure_slack, residual_norms
from retrieval.index.codes import dequantize, quantize_int8
from retrieval.index.scan import encode_int8_cpu


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    d=st.integers(1, 80),
    nlist=st.integers(1, 9),
    scale=st.sampled_from([1e-6, 1.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_encoded_codes_equal_quantized_residuals(n, d, nlist, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * scale
    x[0] = 0.0  # a residual of zeros when it is its own centroid
    centroids = torch.randn(nlist, d, generator=g) * scale
    centroids[0] = x[0]
    lists = torch.randint(0, nlist, (n,), generator=g)
    lists[0] = 0
    order = torch.argsort(lists, stable=True)
    ls = lists[order]
    codes, scales, norms = encode_int8_cpu(x, order, ls, centroids)
    residuals = x[order] - centroids[ls]
    want_codes, want_scales = quantize_int8(residuals)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    decoded = dequantize(want_codes, want_scales).double()  # float32 products, as scored
    true = torch.maximum(residuals.double().norm(dim=1), decoded.norm(dim=1))
    assert bool((norms.double() >= true).all())  # a bound: never rounded below the true norm
    want = residual_norms(residuals, want_codes, want_scales)  # the torch figure, float sums
    torch.testing.assert_close(norms, want, rtol=2e-6, atol=0)


def _decoded_slack(index, queries, quantiles, lists=32):
    """The slack as the build measured it before: residuals decoded to floats, dotted exactly."""
    q = as_scored(index, queries)
    off = index.offsets
    near = (q @ index.centroids.T).topk(lists + 1, dim=1).indices[:, 1:]
    shares = []
    for b in range(len(q)):
        for lst in near[b].tolist():
            s, e = int(off[lst]), int(off[lst + 1])
            if e > s and float(index.list_radius[lst]) > 0:
                best = dequantize(index.codes[s:e], index.scales[s:e]) @ q[b]
                scale = float(q[b].norm()) * float(index.list_radius[lst])
                shares.append(min(max(float(best.max()) / scale, 0.0), 1.0))
    found = torch.tensor(shares)
    return [float(torch.quantile(found, p)) for p in quantiles]


def test_the_slack_from_the_scan_matches_the_decoded_one(catalog):
    cfg = IVFConfig(nlist=64, codes="int8", probe="ip", assign="ip")
    index = build_ivf(catalog["x"], cfg)
    queries = catalog["q"][:64]
    quantiles = (0.5, 0.9, 0.99)
    got = measure_slack(index.tensors(), queries, quantiles)
    want = _decoded_slack(index, queries, quantiles)
    assert got == [float(v) for v in got] and all(0 < v <= 1 for v in got)
    np.testing.assert_allclose(got, want, atol=0.01)  # the int8 query moves a share by < 1 %
