"""The Triton list scan (``retrieval/index/gpu_scan.py``) against the torch reference.

Without a GPU the kernel runs under Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``) on CPU tensors: the same kernel source, checked on small shapes. Tests
marked ``gpu`` run it compiled on a CUDA device, through the index.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.filters import FilterSchema
from retrieval.index import gpu_scan
from retrieval.index.codes import quantize
from retrieval.index.exclude import PAD
from retrieval.index.scan import scan_reference
from retrieval.index.tensors import Lists, ScanRows


def case(
    lengths: list[int],
    b: int,
    p: int,
    d: int,
    kind: str,
    clauses: int,
    words: int,
    excluded: int,
    seed: int,
) -> dict:
    """Random scan inputs: lists of ``lengths``, ``b`` queries probing ``p`` distinct lists each
    (some slots skipped with -1), ``clauses`` random filter clauses over ``words`` signature
    words, ``excluded`` random rows each query excludes."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    nlist = len(lengths)
    codes, scales = quantize(torch.randn(max(n, 1), d, generator=g)[:n], kind)
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    q = torch.randn(b, d, generator=g)
    p = min(p, nlist)
    probes = torch.stack([torch.randperm(nlist, generator=g)[:p] for _ in range(b)])
    probes[torch.rand(b, p, generator=g) < 0.2] = -1
    coarse = torch.randn(b, p, generator=g)
    # sparse bits, so clauses pass some items and fail others
    sig = torch.randint(0, 2**62, (n, words), generator=g) & torch.randint(
        0, 2**62, (n, words), generator=g
    )
    fmask = torch.randint(0, 2**62, (b, clauses, words), generator=g) & torch.randint(
        0, 2**62, (b, clauses, words), generator=g
    )
    fneg = torch.rand(b, clauses, generator=g) < 0.3
    excl = torch.full((b, excluded), PAD, dtype=torch.int64)
    if excluded and n:
        rows = torch.randint(0, n, (b, excluded), generator=g)
        excl = torch.where(torch.rand(b, excluded, generator=g) < 0.8, rows, excl)
        excl = excl.sort(dim=1).values
    return dict(
        q=q,
        probes=probes,
        coarse=coarse,
        codes=codes,
        scales=scales,
        offsets=offsets,
        sig=sig,
        fmask=fmask,
        fneg=fneg,
        excl=excl,
        max_list=max(lengths, default=0),
    )


def bundled(c: dict, excl: torch.Tensor | None = None) -> tuple[Lists, ScanRows]:
    """A :func:`case` as the scans take it (``excl``: other excluded rows than the case's)."""
    lists = Lists(c["codes"], c["scales"], c["offsets"], c["sig"], c["max_list"])
    ex = c["excl"] if excl is None else excl
    return lists, ScanRows(c["q"], c["probes"], c["coarse"], c["fmask"], c["fneg"], ex)


def run_both(c: dict, r: int) -> tuple[tuple, tuple]:
    return scan_reference(*bundled(c), r), gpu_scan.scan_triton(*bundled(c), r)


def assert_same(ref: tuple, got: tuple) -> None:
    """Same scores (to float32 rounding: the kernel may fuse a multiply-add) and the same
    items wherever scores are not tied."""
    (rp, rs), (gp, gs) = ref, got
    assert gp.shape == rp.shape and gs.shape == rs.shape
    assert torch.equal(gp < 0, rp < 0), "the same number of items passes"
    assert torch.equal(torch.isinf(gs), torch.isinf(rs))
    fin = torch.isfinite(rs)
    torch.testing.assert_close(gs[fin], rs[fin], rtol=1e-5, atol=1e-5)
    for row in range(rp.shape[0]):
        keep = rp[row] >= 0
        assert set(gp[row][keep].tolist()) == set(rp[row][keep].tolist()) or _tied(rs[row])


def _tied(scores: torch.Tensor) -> bool:
    s = scores[torch.isfinite(scores)]
    return bool((s[:-1] - s[1:]).abs().min() < 1e-5) if s.numel() > 1 else False


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=6).filter(lambda x: sum(x) > 0),
    b=st.integers(1, 40),
    p=st.integers(1, 4),
    d=st.sampled_from([8, 24, 64]),
    kind=st.sampled_from(["int8", "fp8"]),
    clauses=st.integers(0, 2),
    words=st.integers(1, 2),
    excluded=st.sampled_from([0, 1, 5]),
    r=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_the_reference(lengths, b, p, d, kind, clauses, words, excluded, r, seed):
    c = case(lengths, b, p, d, kind, clauses, words, excluded, seed)
    assert_same(*run_both(c, r))


def test_excluded_rows_widened_with_pad_change_nothing():
    """A CUDA graph takes excluded rows at a bucketed width (``gpu_backend.py`` pads them with PAD):
    the kernel answers as it does at their own width."""
    c = case([120, 0, 300, 77], 6, 3, 24, "int8", 1, 1, 5, seed=11)
    wide = torch.cat([c["excl"], torch.full((6, 3), PAD, dtype=torch.int64)], dim=1)  # 5 -> 8
    got, want = gpu_scan.scan_triton(*bundled(c, wide), 50), gpu_scan.scan_triton(*bundled(c), 50)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert c["excl"].lt(PAD).any()  # some rows do exclude


def test_long_lists_many_queries_filters_and_exclusions():
    """Lists longer than a tile, more queries on a list than a chunk holds, every clause kind."""
    c = case([700, 0, 260, 33, 129], 37, 3, 32, "int8", 2, 2, 9, seed=3)
    assert_same(*run_both(c, 100))


def test_k_beyond_what_the_lists_hold_pads():
    c = case([5, 7], 3, 2, 16, "int8", 0, 1, 0, seed=1)
    (rp, rs), (gp, gs) = run_both(c, 50)
    assert_same((rp, rs), (gp, gs))
    assert (gp[:, 12:] == -1).all() and torch.isinf(gs[:, 12:]).all()


def test_large_batches_go_through_in_chunks(monkeypatch):
    monkeypatch.setattr(gpu_scan, "BUFFER_FLOATS", 2 * 3 * 90)  # two queries a chunk
    c = case([90, 40, 60], 7, 3, 16, "fp8", 1, 1, 2, seed=5)
    assert_same(*run_both(c, 30))


def test_no_filter_clauses_and_no_exclusions():
    c = case([50, 60, 70], 4, 3, 16, "int8", 0, 0, 0, seed=2)
    assert_same(*run_both(c, 20))


def test_real_filters_compiled_by_the_schema():
    """Clauses as the schema compiles them (AND of ORs, NOT)."""
    schema = FilterSchema({"genre": ["a", "b", "c"], "lang": ["x", "y"]})
    n = 300
    rng = np.random.default_rng(0)
    sig = schema.signatures({"genre": rng.integers(0, 3, n), "lang": rng.integers(0, 2, n)}, n)
    fb = schema.compile(["genre in {a, b} and lang = x", "not genre = c", "", "lang = y"])
    c = case([100, 120, 80], 4, 3, 16, "int8", 1, 1, 0, seed=4)
    c.update(sig=sig, fmask=fb.masks, fneg=fb.negate)
    assert_same(*run_both(c, 64))


def test_expressions_with_or_and_ranges_compiled_by_the_schema():
    """The compiled form of or / not / numeric ranges is the same clause shape: the kernel
    evaluates it as the reference does."""
    from retrieval.filters import NUMERIC, eligible

    schema = FilterSchema({"genre": ["a", "b", "c"], "lang": ["x", "y"], "price": NUMERIC})
    n = 300
    rng = np.random.default_rng(1)
    attrs = {
        "genre": rng.integers(0, 3, n),
        "lang": rng.integers(0, 2, n),
        "price": np.round(rng.normal(10, 10, n), 1),
    }
    sig = schema.signatures(attrs, n)
    texts = [
        "(genre = a or lang = y) and price < 12.5",
        "price between 0 and 5 or genre = c",
        "not (price >= 10 or genre = b) and lang != x",
        "price in {10, 0.5, -3}",
    ]
    fb = schema.compile(texts)
    assert all(eligible(sig, fb.masks[r], fb.negate[r]).any() for r in range(4))
    c = case([100, 120, 80], 4, 3, 16, "int8", 1, sig.shape[1], 0, seed=5)
    c.update(sig=sig, fmask=fb.masks, fneg=fb.negate)
    assert_same(*run_both(c, 64))


def test_a_negated_category_inside_an_or_on_a_multi_valued_attribute():
    """ "tag != x or genre = y" (a clause with a "none of these bits" part, ``fnone``) on a
    multi-valued ``tag``: the kernel evaluates it as the reference does."""
    from retrieval.filters import eligible

    schema = FilterSchema({"genre": ["a", "b", "c"], "tag": ["t0", "t1", "t2"]})
    n = 300
    rng = np.random.default_rng(2)
    attrs = {"genre": rng.integers(0, 3, n), "tag": rng.random((n, 3)) < 0.5}
    sig = schema.signatures(attrs, n)
    texts = ["tag != t1 or genre = a", "(tag != t0 or genre in {b, c}) and tag = t2", "genre = b"]
    fb = schema.compile([*texts, "(not tag = t2 or genre = c) and (tag != t1 or genre = a)"])
    assert fb.neg_masks is not None
    want = (~attrs["tag"][:, 1]) | (attrs["genre"] == 0)
    got = eligible(sig, fb.masks[0], fb.negate[0], fb.neg_masks[0]).numpy()
    assert np.array_equal(got, want)
    c = case([100, 120, 80], 4, 3, 16, "int8", 1, sig.shape[1], 0, seed=6)
    c.update(sig=sig, fmask=fb.masks, fneg=fb.negate)
    lists, rows = bundled(c)
    rows = ScanRows(
        rows.q, rows.probes, rows.coarse, rows.fmask, rows.fneg, rows.excl, None, fb.neg_masks
    )
    ref, got_scan = scan_reference(lists, rows, 64), gpu_scan.scan_triton(lists, rows, 64)
    assert_same(ref, got_scan)
    plain = scan_reference(*bundled(c), 64)  # without the negated part: other answers
    assert not torch.equal(plain[0], ref[0])


@pytest.mark.gpu
@pytest.mark.parametrize("codes", ["int8", "fp8"])
def test_index_on_cuda_finds_what_the_cpu_index_finds(codes, catalog):
    from retrieval.index import IVFConfig, build_ivf

    # measure_costs=False: both devices plan by the constant exact_cost. Costs measured at build
    # price the CPU's plans only (a GPU index plans by the constant), so on a CPU whose measured
    # exact plan is cheap (an H200 host's 16 cores) the CPU scanned these rows exactly while the
    # GPU probed lists: other answers, not other arithmetic.
    idx = build_ivf(
        catalog["x"],
        IVFConfig(
            nlist=64, nprobe=8, codes=codes, rerank=0, exact_copy="none", measure_costs=False
        ),
        item_attributes=catalog["attrs"],
        attribute_values=catalog["values"],
    )
    want, ws = idx.search(catalog["q"], 100, "shard in {1,2,3,4,5,6,7,8}")
    gpu = idx.to("cuda")
    got, gs = gpu.search(catalog["q"].cuda(), 100, "shard in {1,2,3,4,5,6,7,8}")
    torch.testing.assert_close(gs.cpu(), ws, rtol=1e-4, atol=1e-4)
    overlap = (got.cpu().unsqueeze(2) == want.unsqueeze(1)).any(2).float().mean()
    assert overlap > 0.99


@pytest.mark.gpu
def test_a_cuda_batch_mixing_exact_and_list_rows_answers_as_on_the_cpu(catalog):
    """Rows of one batch on different plans (a selective filter scanned exactly beside
    unfiltered rows probing lists, with seen items), as a server's warm-up batch sends: the
    plan's row numbers stay on the CPU (a GPU row list indexing the CPU plan failed)."""
    from retrieval.filters import FilterBatch
    from retrieval.index import IVFConfig, build_ivf

    idx = build_ivf(
        catalog["x"],
        IVFConfig(nlist=64, nprobe=8, rerank=0, exact_copy="none", measure_costs=False),
        item_attributes=catalog["attrs"],
        attribute_values=catalog["values"],
    )
    q = catalog["q"][:8]
    filters = ["shard = 1 and bucket = 2" if i % 2 else "" for i in range(8)]
    plan = idx.search_plan(100, filters)
    assert bool(plan.exact.any()) and not bool(plan.exact.all())  # both kinds in one batch
    seen = torch.randint(
        0, catalog["x"].shape[0], (8, 5), generator=torch.Generator().manual_seed(2)
    )
    fb = idx.compile_filter(filters, 8)
    want, ws = idx.search(q, 100, FilterBatch(fb.masks, fb.negate, seen))
    gpu = idx.to("cuda")
    gfb = gpu.compile_filter(filters, 8)
    got, gs = gpu.search(q.cuda(), 100, FilterBatch(gfb.masks, gfb.negate, seen.cuda()))
    torch.testing.assert_close(gs.cpu(), ws, rtol=1e-4, atol=1e-4)
    overlap = (got.cpu().unsqueeze(2) == want.unsqueeze(1)).any(2).float().mean()
    assert overlap > 0.99


@pytest.fixture
def small_index(catalog):
    from retrieval.index import IVFConfig, build_ivf

    return build_ivf(
        catalog["x"][:6000],
        IVFConfig(nlist=32, nprobe=4, rerank=0, exact_copy="none", filter_bound=0.0),
        item_attributes={a: v[:6000] for a, v in catalog["attrs"].items()},
        attribute_values=catalog["values"],
    )


@pytest.mark.parametrize(
    "filters, seen, k",
    [
        (None, 0, 50),  # the plain path
        (None, 20, 50),  # the plain path, excluding seen items
        ("shard in {0,1,2,3,4,5,6,7} and not bucket = 3", 10, 40),  # the planned path
        (None, 0, 1500),  # more than the probed lists hold: the planned path widens
    ],
)
def test_index_searches_through_the_triton_kernel(
    small_index, catalog, monkeypatch, filters, seen, k
):
    """Whole searches with the scan forced onto the Triton kernel (interpreted here) answer as
    the C++ kernel does."""
    from retrieval.filters import FilterBatch
    from retrieval.index.scan import KERNEL_ENV

    q = catalog["q"][:8]
    fb = small_index.compile_filter(filters, len(q))
    if seen:
        ids = torch.randint(0, 6000, (len(q), seen), generator=torch.Generator().manual_seed(0))
        fb = FilterBatch(fb.masks, fb.negate, ids)
    want, ws = small_index.search(q, k, fb)
    monkeypatch.setenv(KERNEL_ENV, "triton")
    got, gs = small_index.search(q, k, fb)
    torch.testing.assert_close(gs, ws, rtol=1e-4, atol=1e-4)
    same = (got.unsqueeze(2) == want.unsqueeze(1)).any(2) | (want < 0)
    assert float(same.float().mean()) > 0.99


def test_width_bound_follows_the_offsets_it_was_read_for():
    offsets = torch.tensor([0, 5, 12, 14])  # lists of 5, 7, 2
    assert gpu_scan.width_bound(offsets, 1) == 7
    assert gpu_scan.width_bound(offsets, 2) == 12
    assert gpu_scan.width_bound(offsets, 9) == 14
    offsets[3] = 40  # an in-place change (a live update): read again
    assert gpu_scan.width_bound(offsets, 1) == 28
    assert gpu_scan.width_bound(torch.tensor([0, 3, 4]), 1) == 3  # another tensor


def test_width_bound_caps_each_list_at_what_the_kernel_keeps():
    offsets = torch.tensor([0, 5, 12, 14])  # lists of 5, 7, 2
    assert gpu_scan.width_bound(offsets, 2, keep=3) == 6  # the two longest, 3 each
    assert gpu_scan.width_bound(offsets, 3, keep=6) == 6 + 5 + 2  # only the 7 is capped
    assert gpu_scan.width_bound(offsets, 3, keep=9) == gpu_scan.width_bound(offsets, 3)
    assert gpu_scan.kept_per_list(offsets, 3) == 3  # a list longer than r: the kernel selects
    assert gpu_scan.kept_per_list(offsets, 7) is None  # no list longer: every item written
    assert gpu_scan.kept_per_list(torch.tensor([0, 500]), gpu_scan.SELECT_MAX + 1) is None


def test_selecting_in_the_kernel_answers_as_the_full_rows(monkeypatch):
    """The in-kernel selection against the full score rows it replaces, ties included."""
    c = case([700, 0, 260, 33, 129], 20, 3, 16, "fp8", 1, 1, 3, seed=8)
    c["codes"][100:300], c["scales"][100:300] = c["codes"][100], c["scales"][100]  # ties
    for r in (1, 16, 100):
        picked = gpu_scan.scan_triton(*bundled(c), r)
        monkeypatch.setattr(gpu_scan, "SELECT_MAX", 0)
        full = gpu_scan.scan_triton(*bundled(c), r)
        monkeypatch.undo()
        assert gpu_scan.kept_per_list(c["offsets"], r) == r
        torch.testing.assert_close(picked[1], full[1])
        assert_same(picked, full)


def test_the_d_tile_is_what_an_int8_dot_compiles_for():
    """An H200 refused K = 16 for int8 `tl.dot` (the interpreter does not): D = 16 pads to 32."""
    assert [gpu_scan.block_d(d) for d in (1, 16, 32, 33, 64, 100)] == [32, 32, 32, 64, 64, 128]


def test_graph_buckets_are_powers_of_two():
    from retrieval.index.cuda_graphs import bucket

    assert [bucket(b) for b in (1, 2, 3, 4, 5, 17, 32)] == [1, 2, 4, 4, 8, 32, 32]


def test_without_a_gpu_the_search_runs_eagerly(small_index, catalog):
    from retrieval.index.cuda_graphs import run_graphed

    calls = []

    def fn(q, ex):
        calls.append((q.shape[0], ex.shape))
        return (q * 2,)

    ex = torch.zeros(3, 5, dtype=torch.int64)
    (out,) = run_graphed(small_index, "k", fn, (catalog["q"][:3], ex), (small_index.codes,))
    assert calls == [(3, (3, 5))] and torch.equal(out, catalog["q"][:3] * 2)


@pytest.mark.gpu
def test_graphed_searches_equal_eager_ones_and_follow_updates(small_index, catalog, monkeypatch):
    """One-query and small-batch searches replay CUDA graphs: the same answers as without them,
    for every batch size of a bucket, and a live update (new items) is searched at once."""
    from retrieval.index.cuda_graphs import GRAPHS_ENV
    from retrieval.index.update import add_items

    gpu = small_index.to("cuda")
    q = catalog["q"][:5].cuda()
    for b in (1, 3, 4, 5):
        got = gpu.search(q[:b], 20)
        monkeypatch.setenv(GRAPHS_ENV, "0")
        want = gpu.search(q[:b], 20)
        monkeypatch.delenv(GRAPHS_ENV)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # new items equal to the queries (scaled up): each query's best answer is its new item
    ids = torch.arange(10_000, 10_005)
    updated = add_items(gpu, ids, catalog["q"][:5] * 4, gpu.sig[:5].cpu())
    top = updated.search(q, 1)[0].cpu().flatten()
    assert torch.equal(top, ids)


@pytest.mark.gpu
def test_graphed_searches_with_seen_items_equal_eager_ones(small_index, catalog, monkeypatch):
    """A served request excludes its history: that search replays a graph too (the excluded
    rows are one of its inputs, their width bucketed with PAD), with the eager search's
    answers for every batch size and seen-list width, and no seen item in them."""
    from retrieval.filters import FilterBatch
    from retrieval.index.cuda_graphs import _CACHES, GRAPHS_ENV

    gpu = small_index.to("cuda")
    q = catalog["q"][:5].cuda()
    g = torch.Generator().manual_seed(3)
    for b, width in ((1, 3), (3, 5), (4, 8), (5, 5)):
        seen = torch.randint(0, 6000, (b, width), generator=g)
        seen[0, -1] = -1  # a padded slot
        fb = gpu.compile_filter(None, b)
        fb = FilterBatch(fb.masks, fb.negate, seen.cuda())
        got = gpu.search(q[:b], 20, fb)
        monkeypatch.setenv(GRAPHS_ENV, "0")
        want = gpu.search(q[:b], 20, fb)
        monkeypatch.delenv(GRAPHS_ENV)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (b, width)
        assert not (got[0].cpu().unsqueeze(2) == seen.unsqueeze(1)).any()
    graphs = _CACHES[gpu].values()
    assert any(e.graph is not None and len(e.inputs) == 2 for e in graphs)  # replayed, not eager


@pytest.mark.gpu
def test_graphs_record_and_replay_while_other_threads_search(small_index, catalog, monkeypatch):
    """A server's threads search at once: some record a graph while others replay or run
    eagerly; every answer equals the eager search."""
    from concurrent.futures import ThreadPoolExecutor

    from retrieval.index.cuda_graphs import GRAPHS_ENV

    gpu = small_index.to("cuda")
    q = catalog["q"][:32].cuda()
    sizes = [1, 2, 3, 5, 8, 13, 21, 32] * 4
    monkeypatch.setenv(GRAPHS_ENV, "0")
    want = {b: gpu.search(q[:b], 10) for b in set(sizes)}
    monkeypatch.delenv(GRAPHS_ENV)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda b: (b, gpu.search(q[:b], 10)), sizes))
    for b, (ids, scores) in got:
        assert torch.equal(ids, want[b][0]) and torch.equal(scores, want[b][1]), b
