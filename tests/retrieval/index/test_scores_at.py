"""The exact plan's scores read off int8 codes: a few CPU queries take one C++ pass
(``scan.score_rows_cpu``), more take decoded rows and a matmul; both answer
``q·code * scale + q·centroid``. Many queries over many wide rows take one int8 GEMM
(``scan.many_rows_cpu``), which answers the list scan's formula, the query quantized."""

from __future__ import annotations

import pytest
import torch

from retrieval.index import IVFConfig, build_ivf, cpu_backend
from retrieval.index.codes import quantize_query_int8
from retrieval.index.probe import FEW_QUERIES
from retrieval.index.scan import ISA_ENV, many_rows_cpu, score_rows_cpu
from tests.retrieval.index.reference import kept_plan, planned_ids


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
    direct = score_rows_cpu(q, pos, index.tensors().lists, q @ index.centroids.T)
    torch.testing.assert_close(direct, torch_scores(index, q, pos), rtol=1e-5, atol=1e-4)


def test_a_row_out_of_range_is_refused(index, catalog):
    q = catalog["q"][:1]
    with pytest.raises(RuntimeError, match="pos out of range"):
        score_rows_cpu(
            q, torch.tensor([index.ntotal]), index.tensors().lists, q @ index.centroids.T
        )


@pytest.mark.parametrize("d", [5, 8, 37, 784])
def test_any_dimension_scores_like_the_torch_formula(d):
    """Dimensions below, at and past the 8- and 16-wide SIMD steps, with tails."""
    g = torch.Generator().manual_seed(d)
    index = build_ivf(torch.randn(400, d, generator=g), IVFConfig(nlist=8, codes="int8"))
    q, pos = torch.randn(2, d, generator=g), torch.randperm(400, generator=g)[:50]
    got = score_rows_cpu(q, pos, index.tensors().lists, q @ index.centroids.T)
    torch.testing.assert_close(got, torch_scores(index, q, pos), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("d", [7, 24, 784])
def test_the_simd_path_returns_the_portable_bits(d, monkeypatch):
    """The AVX2 + FMA scorer and the portable loop sum in the same order: the same floats."""
    g = torch.Generator().manual_seed(d)
    index = build_ivf(torch.randn(300, d, generator=g), IVFConfig(nlist=4, codes="int8"))
    q, pos = torch.randn(3, d, generator=g), torch.arange(300)
    args = (q, pos, index.tensors().lists, q @ index.centroids.T)
    monkeypatch.setenv(ISA_ENV, "portable")
    portable = score_rows_cpu(*args)
    monkeypatch.setenv(ISA_ENV, "auto")
    assert torch.equal(score_rows_cpu(*args), portable)


def list_scan_scores(index, q, pos):
    """The list scan's formula: q·c of the row's list + scale x the query's scale x the dot of
    the int8 query and code."""
    q8, qs = quantize_query_int8(q)
    lists = torch.searchsorted(index.offsets, pos, right=True) - 1
    dots = (q8.int() @ index.codes.index_select(0, pos).int().T).float()
    scale = index.scales.index_select(0, pos).float()
    return (q @ index.centroids.T).index_select(1, lists) + scale[None, :] * qs[:, None] * dots


def grouped(d: int):
    """3,000 items of ``d`` dimensions, half of them in group 0. No measured costs and a tiny
    exact cost: a filtered row's plan is the exact scan."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3000, d, generator=g)
    group = torch.arange(3000) % 2
    return build_ivf(
        x,
        IVFConfig(nlist=16, codes="int8", rerank=0, measure_costs=False, exact_cost=1e-6),
        item_attributes={"group": group},
        attribute_values={"group": [0, 1]},
    )


@pytest.fixture(scope="module")
def wide():
    """160-d: past the GEMM's 128 dimensions (:func:`grouped`)."""
    return grouped(160)


@pytest.fixture(scope="module")
def narrow():
    """50-d: below the GEMM's 128 dimensions, decoded rows and float matmuls (:func:`grouped`)."""
    return grouped(50)


@pytest.mark.parametrize("order", ["ascending", "shuffled"])
def test_many_queries_over_many_wide_rows_score_as_the_list_scan(wide, order):
    """20 queries (more than FEW_QUERIES) x 1,500 rows (past 1,024) at 160-d: the int8 GEMM,
    rows in list order (one run a list) or in any order."""
    g = torch.Generator().manual_seed(1)
    pos = torch.randperm(wide.ntotal, generator=g)[:1500]
    pos = pos.sort().values if order == "ascending" else pos
    q = torch.randn(FEW_QUERIES + 4, 160, generator=g)
    got = wide.scores_at(q, pos)
    torch.testing.assert_close(got, list_scan_scores(wide, q, pos), rtol=1e-5, atol=1e-4)


def test_the_gemm_and_the_float_matmul_split_at_1024_rows(wide):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(FEW_QUERIES + 4, 160, generator=g)
    few, many = torch.arange(1023), torch.arange(1024)
    args = (wide.tensors().lists, wide.centroids_t)
    torch.testing.assert_close(
        many_rows_cpu(q, few, *args), torch_scores(wide, q, few), rtol=1e-5, atol=1e-4
    )
    torch.testing.assert_close(
        many_rows_cpu(q, many, *args), list_scan_scores(wide, q, many), rtol=1e-5, atol=1e-4
    )


def test_the_one_call_exact_search_answers_the_planned_path_over_the_gemm(wide):
    """The one C++ call (its scores in a buffer it keeps) and the planned path's exact rows
    (``scores_at``): the same ids and scores, twice over (the buffer reused)."""
    g = torch.Generator().manual_seed(3)
    for batch in (FEW_QUERIES + 4, 40):
        q = torch.randn(batch, 160, generator=g)
        fb = wide.compile_filter("group = 0", batch)
        plan_exact = wide.search_plan(100, "group = 0", batch=batch, nprobe=16)
        got = cpu_backend.shared_exact_ids(wide.tensors(), q, fb, kept_plan(wide, q, 100, fb, 16))
        want, scores = planned_ids(wide, q, 100, fb, 16)
        assert bool(plan_exact.exact.all()) and got is not None
        assert torch.equal(got[0], want) and torch.equal(got[1], scores)


@pytest.mark.parametrize("batch", [FEW_QUERIES + 1, 40, 77, 200])
def test_the_one_call_answers_the_planned_path_a_block_of_queries_at_a_time(narrow, batch):
    """Many queries over decoded rows (50-d): the one call scores, selects and maps a block of
    queries at a time, the planned path's ``scores_at`` scores the same blocks; the same ids and
    scores, whatever the batch's split into blocks, and the scores the torch formula's."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(batch, 50, generator=g)
    fb = narrow.compile_filter("group = 0", batch)
    got = cpu_backend.shared_exact_ids(narrow.tensors(), q, fb, kept_plan(narrow, q, 100, fb, 16))
    want, scores = planned_ids(narrow, q, 100, fb, 16)
    assert got is not None and torch.equal(got[0], want) and torch.equal(got[1], scores)
    pos = torch.arange(0, narrow.ntotal, 2)  # the list-sorted rows, every other one
    torch.testing.assert_close(
        narrow.scores_at(q, pos), torch_scores(narrow, q, pos), rtol=1e-5, atol=1e-4
    )
