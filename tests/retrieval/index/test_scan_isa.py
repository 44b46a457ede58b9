"""The int8 scan's SIMD paths (AVX2, AVX-512 VNNI) against its portable loops and torch.

``$RECSERVE_SCAN_ISA`` forces a path per call, so one process compares them. A path this CPU
cannot run is skipped (on an AVX2-only machine the VNNI tests are skipped, not passed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.index import IVFConfig, build_ivf
from retrieval.index.scan import ISA_ENV, int8_isa, scan
from retrieval.index.tensors import Lists, ScanRows

SIMD = ["avx2", "vnni"]


def runs_here(isa: str) -> bool:
    """Whether this CPU runs ``isa`` (the kernel refuses a forced path it cannot run)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ISA_ENV, isa)
        try:
            return int8_isa() == isa
        except RuntimeError:
            return False


def need(isa: str) -> None:
    if not runs_here(isa):
        pytest.skip(f"this CPU cannot run the {isa} path")


def bundled(args: tuple, max_list: int) -> tuple[Lists, ScanRows, int]:
    """:func:`lists_case`'s inputs as the scan takes them."""
    q, probes, coarse, codes, scales, offsets, sig, fmask, fneg, r = args
    return Lists(codes, scales, offsets, sig, max_list), ScanRows(q, probes, coarse, fmask, fneg), r


def scan_with(isa: str, args: tuple, max_list: int) -> tuple[torch.Tensor, torch.Tensor]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ISA_ENV, isa)
        return scan(*bundled(args, max_list))


def lists_case(d: int, lengths: list[int], b: int, shared: bool, seed: int, integer: bool):
    """Scan inputs over random int8 codes (the full range, -128 included) in lists of ``lengths``.

    ``integer``: queries are integers with one component at 127, scales 1 and coarse 0, so that
    the kernel's query quantization is exact and every score is the exact integer dot (below 2^24,
    so exact in float32 too). ``shared``: every query probes every list (the transposed path);
    else each query probes one list of its own (the row path).
    """
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    codes = torch.randint(-128, 128, (n, d), dtype=torch.int8, generator=g)
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    nlist = len(lengths)
    if integer:
        q = torch.randint(-127, 128, (b, d), generator=g).float()
        q[torch.arange(b), torch.randint(0, d, (b,), generator=g)] = 127.0
        scales = torch.ones(n, dtype=torch.bfloat16)
    else:
        q = torch.randn(b, d, generator=g)
        scales = (torch.rand(n, generator=g) + 0.01).bfloat16()
    if shared:
        probes = torch.arange(nlist).repeat(b, 1)
    else:
        probes = torch.randint(0, nlist, (b, 1), generator=g)
    coarse = torch.zeros(probes.shape) if integer else torch.randn(probes.shape, generator=g)
    sig = torch.zeros(n, 1, dtype=torch.int64)
    fmask = torch.zeros(b, 0, 1, dtype=torch.int64)
    fneg = torch.zeros(b, 0, dtype=torch.bool)
    r = max(n, 1)
    args = (q, probes, coarse, codes, scales, offsets, sig, fmask, fneg, r)
    return args, max(max(lengths), 1)


DIMS = st.one_of(st.sampled_from([1, 31, 33, 64, 784]), st.integers(1, 300))
LENGTHS = st.lists(st.integers(0, 150), min_size=1, max_size=5).filter(lambda ls: sum(ls) > 0)
"""List lengths: above 64 a transposed list is scored 4 blocks of 16 at a time."""
BATCHES = st.one_of(st.integers(1, 5), st.integers(16, 18))
"""Queries: with VNNI, a list that 16 of them probe (``shared``) is transposed first."""


@pytest.mark.parametrize("isa", SIMD)
@settings(max_examples=40, deadline=None)
@given(d=DIMS, lengths=LENGTHS, b=BATCHES, shared=st.booleans(), seed=st.integers(0, 99))
def test_simd_dots_are_the_exact_integer_dots(isa, d, lengths, b, shared, seed):
    need(isa)
    args, max_list = lists_case(d, lengths, b, shared, seed, integer=True)
    q, probes, codes, offsets = args[0], args[1], args[3], args[5]
    truth = q.long() @ codes.long().T  # [B, N] exact integer dots
    for path in ("portable", isa):
        pos, sc = scan_with(path, args, max_list)
        for row in range(q.shape[0]):
            lists = probes[row]
            want = torch.cat([torch.arange(offsets[li], offsets[li + 1]) for li in lists.tolist()])
            got = pos[row][pos[row] >= 0]
            assert sorted(got.tolist()) == sorted(want.tolist()), path
            assert torch.equal(sc[row, : got.numel()].long(), truth[row, got]), path


@pytest.mark.parametrize("isa", SIMD)
@settings(max_examples=25, deadline=None)
@given(d=DIMS, lengths=LENGTHS, b=BATCHES, shared=st.booleans(), seed=st.integers(0, 99))
def test_simd_scan_equals_portable_bitwise(isa, d, lengths, b, shared, seed):
    need(isa)
    args, max_list = lists_case(d, lengths, b, shared, seed, integer=False)
    pos, sc = scan_with("portable", args, max_list)
    spos, ssc = scan_with(isa, args, max_list)
    assert torch.equal(sc, ssc)
    assert torch.equal(pos, spos)
    _, rsc = scan(*bundled(args, max_list), reference=True)
    torch.testing.assert_close(ssc, rsc, rtol=1e-5, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(
    d=st.sampled_from([8, 64]),
    lengths=st.lists(st.integers(0, 60), min_size=1, max_size=6).filter(lambda ls: sum(ls) > 0),
    b=st.integers(1, 4),
    shared=st.booleans(),
    seed=st.integers(0, 99),
    share=st.floats(0.0, 1.0),
)
def test_the_best_r_are_the_head_of_the_whole_ranking_heap_or_selection(
    d, lengths, b, shared, seed, share
):
    """Small r goes through the bounded heap, r near the candidates' count through a selection
    (nth_element): either way the best r scores, best first, are the whole ranking's head, and
    each position returned scores what the whole ranking gave it."""
    args, max_list = lists_case(d, lengths, b, shared, seed, integer=False)
    full_pos, full_sc = scan(*bundled(args, max_list))  # r = N: every candidate, ranked
    r = max(1, round(share * sum(lengths)))
    pos, sc = scan(*bundled((*args[:-1], r), max_list))
    assert torch.equal(sc, full_sc[:, :r])
    for row in range(pos.shape[0]):
        given_score = dict(zip(full_pos[row].tolist(), full_sc[row].tolist(), strict=True))
        for p, v in zip(pos[row].tolist(), sc[row].tolist(), strict=True):
            assert p == -1 or given_score[p] == v


@pytest.mark.parametrize("isa", ["portable", *SIMD])
@settings(max_examples=25, deadline=None)
@given(
    d=DIMS,
    lengths=LENGTHS,
    b=BATCHES,
    shared=st.booleans(),
    seed=st.integers(0, 99),
    share=st.sampled_from([0.05, 0.3, 0.6, 0.95]),
)
def test_filtered_scan_scores_only_what_passes_with_the_same_bits(
    isa, d, lengths, b, shared, seed, share
):
    """A filtered pair scores only its passing items when few pass (else the whole list, then
    blanks): either way, the unfiltered scan's scores of the passing items, bit for bit."""
    if isa != "portable":
        need(isa)
    args, max_list = lists_case(d, lengths, b, shared, seed, integer=False)
    q, probes, coarse, codes, scales, offsets, _, _, _, r = args
    g = torch.Generator().manual_seed(seed)
    n = codes.shape[0]
    sig = torch.where(torch.rand(n, generator=g) < share, 1, 2).long().view(n, 1)  # bit 0: passes
    fmask = torch.ones(b, 1, 1, dtype=torch.int64)
    fneg = torch.zeros(b, 1, dtype=torch.bool)
    pos, sc = scan_with(
        isa, (q, probes, coarse, codes, scales, offsets, sig, fmask, fneg, r), max_list
    )
    all_pos, all_sc = scan_with(isa, args, max_list)
    for row in range(b):
        keep = (all_pos[row] >= 0) & (sig[all_pos[row].clamp(min=0), 0] == 1)
        m = int(keep.sum())
        assert torch.equal(pos[row, :m], all_pos[row][keep])
        assert torch.equal(sc[row, :m], all_sc[row][keep])
        assert bool((pos[row, m:] == -1).all())


@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("d", [33, 784])
def test_index_search_is_the_same_on_every_path(isa, d):
    need(isa)
    g = torch.Generator().manual_seed(d)
    x = torch.randn(3000, d, generator=g)
    q = torch.randn(40, d, generator=g)
    rng = np.random.default_rng(d)
    index = build_ivf(
        x,
        IVFConfig(nlist=32, nprobe=6, codes="int8"),
        item_attributes={"shard": rng.integers(0, 4, 3000)},
        attribute_values={"shard": ["0", "1", "2", "3"]},
    )
    for filters in (None, "shard in {0,2}"):
        for batch in (q, q[:1]):  # shared lists (transposed) and one query (rows)
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(ISA_ENV, "portable")
                ids, scores = index.search(batch, 50, filters)
                mp.setenv(ISA_ENV, isa)
                sids, sscores = index.search(batch, 50, filters)
            assert torch.equal(ids, sids)
            assert torch.equal(scores, sscores)


def test_unknown_or_unrunnable_path_is_refused(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "sse9")
    with pytest.raises(
        RuntimeError, match="RECSERVE_SCAN_ISA must be auto, portable, avx2 or vnni"
    ):
        int8_isa()
    for isa in SIMD:
        if not runs_here(isa):
            monkeypatch.setenv(ISA_ENV, isa)
            with pytest.raises(RuntimeError, match="cannot run"):
                int8_isa()


def test_default_is_the_best_path_this_cpu_runs(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    best = next((isa for isa in ("vnni", "avx2") if runs_here(isa)), "portable")
    assert int8_isa() == best
