"""The exact plan's scores read off int8 codes: a few CPU queries take one C++ pass
(``scan.score_rows_cpu``), more take the torch ops; both answer ``q·code * scale + q·centroid``."""

from __future__ import annotations

import pytest
import torch

from retrieval.index import IVFConfig, build_ivf
from retrieval.index.scan import ISA_ENV, score_rows_cpu


@pytest.fixture(scope="module")
def index(catalog):
    return build_ivf(catalog["x"], IVFConfig(nlist=32, codes="int8", rerank=0))


def torch_scores(index, q, pos):
    lists = torch.searchsorted(index.offsets, pos, right=True) - 1
    dots = q @ index.codes.index_select(0, pos).float().T
    return dots * index.scales.index_select(0, pos) + (q @ index.centroids.T).index_select(1, lists)


@pytest.mark.parametrize("isa", ["portable", "auto"])
@pytest.mark.parametrize("b", [1, 3, 16, 17])
def test_scores_of_chosen_rows_equal_the_torch_formula(index, catalog, b, isa, monkeypatch):
    """The portable loop and the CPU's SIMD path (AVX2 + FMA where it has them) alike."""
    monkeypatch.setenv(ISA_ENV, isa)
    g = torch.Generator().manual_seed(b)
    starts = index.offsets[:-1][index.offsets[1:] > index.offsets[:-1]]
    pos = torch.cat([starts, starts[1:] - 1, torch.randint(0, index.ntotal, (300,), generator=g)])
    q = catalog["q"][:b]
    got = index.scores_at(q, pos)  # 17 queries: the torch ops
    torch.testing.assert_close(got, torch_scores(index, q, pos), rtol=1e-5, atol=1e-4)
    direct = score_rows_cpu(q, pos, index.codes, index.scales, index.offsets, q @ index.centroids.T)
    torch.testing.assert_close(direct, torch_scores(index, q, pos), rtol=1e-5, atol=1e-4)


def test_a_row_out_of_range_is_refused(index, catalog):
    q = catalog["q"][:1]
    with pytest.raises(RuntimeError, match="pos out of range"):
        score_rows_cpu(q, torch.tensor([index.ntotal]), index.codes, index.scales,
                       index.offsets, q @ index.centroids.T)  # fmt: skip


@pytest.mark.parametrize("d", [5, 8, 37, 784])
def test_any_dimension_scores_like_the_torch_formula(d):
    """Dimensions below, at and past the 8- and 16-wide SIMD steps, with tails."""
    g = torch.Generator().manual_seed(d)
    index = build_ivf(torch.randn(400, d, generator=g), IVFConfig(nlist=8, codes="int8"))
    q, pos = torch.randn(2, d, generator=g), torch.randperm(400, generator=g)[:50]
    got = score_rows_cpu(q, pos, index.codes, index.scales, index.offsets, q @ index.centroids.T)
    torch.testing.assert_close(got, torch_scores(index, q, pos), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("d", [7, 24, 784])
def test_the_simd_path_returns_the_portable_bits(d, monkeypatch):
    """The AVX2 + FMA scorer and the portable loop sum in the same order: the same floats."""
    g = torch.Generator().manual_seed(d)
    index = build_ivf(torch.randn(300, d, generator=g), IVFConfig(nlist=4, codes="int8"))
    q, pos = torch.randn(3, d, generator=g), torch.arange(300)
    args = (q, pos, index.codes, index.scales, index.offsets, q @ index.centroids.T)
    monkeypatch.setenv(ISA_ENV, "portable")
    portable = score_rows_cpu(*args)
    monkeypatch.setenv(ISA_ENV, "auto")
    assert torch.equal(score_rows_cpu(*args), portable)
