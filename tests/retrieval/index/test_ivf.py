"""The in-model IVF index: recall, filters, K, state_dict round trip, kernel vs reference."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.filters import eligible
from retrieval.index import IVFConfig, IVFIndex, build_ivf, exact_search, recall_at_k
from retrieval.index.scan import scan
from retrieval.index.tensors import ScanRows


@pytest.fixture(scope="module", params=["int8", "fp8"])
def index(request, catalog) -> IVFIndex:
    cfg = IVFConfig(nlist=128, nprobe=16, codes=request.param, rerank=200)
    return build_ivf(
        catalog["x"], cfg, item_attributes=catalog["attrs"], attribute_values=catalog["values"]
    )


def eligible_ids(index: IVFIndex, text: str) -> torch.Tensor:
    """Bool [N] over original item ids."""
    fb = index.compile_filter(text, 1)
    ok = eligible(index.sig, fb.masks[0], fb.negate[0])
    out = torch.zeros(index.ntotal, dtype=torch.bool)
    out[index.item_ids[ok]] = True
    return out


def test_recall_at_100_vs_exact_default_setting(index, catalog):
    truth, _ = exact_search(catalog["x"], catalog["q"], 100)
    ids, scores = index.search(catalog["q"], 100)
    assert recall_at_k(ids, truth) >= 0.95
    assert torch.all(scores[:, :-1] >= scores[:, 1:])  # best first


def test_approximate_scores_alone_keep_recall(index, catalog):
    truth, _ = exact_search(catalog["x"], catalog["q"], 100)
    ids, _ = index.search(catalog["q"], 100, rerank=0)
    assert recall_at_k(ids, truth) >= 0.95


@pytest.mark.parametrize(
    "text",
    [
        "shard in {0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}",
        "shard in {0,1,2,3} and bucket in {0,1,2,3,4,5}",
        "shard = 0 and bucket = 0",
        "not shard in {0,1,2} and bucket != 5",
    ],
)
def test_filtered_recall_and_only_eligible(index, catalog, text):
    ok = eligible_ids(index, text)
    truth, _ = exact_search(catalog["x"], catalog["q"], 100, eligible=ok)
    ids, _ = index.search(catalog["q"], 100, text)
    assert ok[ids[ids >= 0]].all()
    assert recall_at_k(ids, truth) >= 0.95


@settings(max_examples=25, deadline=None)
@given(
    shards=st.sets(st.integers(0, 31), min_size=1, max_size=32),
    buckets=st.sets(st.integers(0, 31), min_size=1, max_size=32),
    negate=st.booleans(),
    k=st.integers(1, 300),
)
def test_filtered_results_never_hold_an_ineligible_item(index, catalog, shards, buckets, negate, k):
    text = ("not " if negate else "") + f"shard in {{{','.join(map(str, sorted(shards)))}}}"
    text += f" and bucket in {{{','.join(map(str, sorted(buckets)))}}}"
    ok = eligible_ids(index, text)
    ids, scores = index.search(catalog["q"][:8], k, text)
    found = ids[ids >= 0]
    assert ok[found].all()
    # every row is full unless fewer than k items are eligible
    assert ((ids >= 0).sum(dim=1) == min(k, int(ok.sum()))).all()
    assert torch.isinf(scores[ids < 0]).all()


def test_empty_eligible_set_gives_an_empty_result(catalog):
    values = {"shard": [str(i) for i in range(33)]}
    idx = build_ivf(
        catalog["x"],
        IVFConfig(nlist=64),
        item_attributes={"shard": catalog["attrs"]["shard"]},
        attribute_values=values,
    )
    ids, scores = idx.search(catalog["q"][:4], 10, "shard = 32")  # a value no item has
    assert (ids == -1).all() and torch.isinf(scores).all()


def test_k_10000(index, catalog):
    truth, _ = exact_search(catalog["x"], catalog["q"][:4], 10_000)
    ids, _ = index.search(catalog["q"][:4], 10_000)
    assert ids.shape == (4, 10_000) and (ids >= 0).all()
    assert all(len(set(r.tolist())) == 10_000 for r in ids)
    assert recall_at_k(ids, truth) >= 0.95


def test_state_dict_round_trip(index, catalog):
    buf = io.BytesIO()
    torch.save(index.state_dict(), buf)
    buf.seek(0)
    fresh = IVFIndex(index.config, index.dim)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    for name, b in index.named_buffers():
        assert torch.equal(
            b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
            getattr(fresh, name).view(torch.uint8)
            if b.dtype == torch.float8_e4m3fn
            else getattr(fresh, name),
        )
    text = "shard in {1,2,3}"
    assert torch.equal(
        index.search(catalog["q"], 50, text)[0], fresh.search(catalog["q"], 50, text)[0]
    )


def test_loading_another_config_names_the_tensor(index):
    other = IVFIndex(IVFConfig(codes="int8"), index.dim + 1)
    with pytest.raises(Exception, match=r"centroids|dim"):
        other.load_state_dict(index.state_dict())


@pytest.mark.parametrize(
    "bad",
    [
        dict(q=torch.zeros(2, 5)),
        dict(k=0),
        dict(k=10**9),
        dict(q=torch.zeros(2, 32, dtype=torch.int64)),
        dict(filters="colour = red"),
        dict(filters="shard = 99"),
        dict(filters="shard in {1,"),
    ],
)
def test_bad_input_raises_value_error(index, catalog, bad):
    args = dict(q=catalog["q"][:2], k=10, filters=None) | bad
    with pytest.raises(ValueError):
        index.search(args["q"], args["k"], args["filters"])


@pytest.mark.parametrize(
    "batch", [1, 64]
)  # 1: per-item path; 64: lists shared by queries (blocked path)
def test_kernel_equals_torch_reference(index, catalog, batch):
    q = catalog["q"][:batch]
    coarse, probes = (q @ index.centroids.T).topk(16, dim=1)
    probes[:, -3:] = -1  # skipped slots
    fb = index.compile_filter("shard in {0,1,2,3,4,5,6,7,8,9} and not bucket = 3", q.shape[0])
    lists, rows = index.tensors().lists, ScanRows(q, probes, coarse, fb.masks, fb.negate)
    pos, sc = scan(lists, rows, 150)
    rpos, rsc = scan(lists, rows, 150, reference=True)
    torch.testing.assert_close(sc, rsc, rtol=1e-5, atol=1e-4)
    assert (pos == rpos).float().mean() > 0.99  # ties may swap


@pytest.mark.parametrize(
    "texts",
    [
        ["shard in {0,1,2}", "shard in {0,1,2}", "shard = 5", "shard in {0,1,2}", "shard = 5"],
        ["shard in {0,1,2,3} and not bucket = 3"] * 2 + ["shard = 1 and bucket in {0,1}"] * 2,
    ],
)
def test_rows_sharing_lists_each_get_their_own_filter(index, catalog, texts):
    """The kernel tests a list's items once for consecutive rows with the same filter; rows with
    another filter in between (one clause, or several) still get theirs: every row of the batch
    answers as it does alone over the same lists."""
    rows = len(texts) * 4
    q = catalog["q"][:rows]
    coarse, probes = (q @ index.centroids.T).topk(8, dim=1)
    fb = index.compile_filter([texts[i % len(texts)] for i in range(rows)], rows)
    lists, every = index.tensors().lists, ScanRows(q, probes, coarse, fb.masks, fb.negate)
    pos, sc = scan(lists, every, 50)
    for b in range(rows):
        one = slice(b, b + 1)
        alone = scan(lists, every.part(one), 50)
        assert torch.equal(pos[one], alone[0]) and torch.equal(sc[one], alone[1])


def test_memory_is_reported_per_buffer(index):
    mem = index.memory_bytes()
    assert mem["codes"] == index.ntotal * index.dim
    assert set(mem) >= {"centroids", "offsets", "item_ids", "codes", "scales", "sig"}


@pytest.mark.gpu
def test_cuda_search_matches_cpu(index, catalog):
    gpu = IVFIndex(index.config, index.dim, index.schema.to_dict())
    gpu.load_state_dict(index.state_dict())
    gpu = gpu.to("cuda")
    ids, _ = gpu.search(catalog["q"].cuda(), 100, "shard in {0,1,2,3}")
    cpu_ids, _ = index.search(catalog["q"], 100, "shard in {0,1,2,3}")
    assert recall_at_k(ids.cpu(), cpu_ids) >= 0.98


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 20),
    cols=st.integers(1, 300),
    k=st.integers(1, 300),
    seed=st.integers(0, 99),
)
def test_topk_rows_matches_torch_topk(rows, cols, k, seed):
    from retrieval.index.scan import topk_rows

    k = min(k, cols)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    v, i = topk_rows(x, k)
    tv, _ = x.topk(k, dim=1)
    torch.testing.assert_close(v, tv)
    torch.testing.assert_close(x.gather(1, i), v)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 3000),
    k=st.integers(1, 200),
    levels=st.integers(1, 6),
    seed=st.integers(0, 999),
)
def test_topk_rows_keeps_the_lower_index_at_ties(rows, cols, k, levels, seed):
    """Few distinct scores (ties at the cut), -inf entries (never results) and -0 beside +0:
    the best k by score, the lower indices kept at the cut, -1 / -inf padded. The selections
    (k a large share of the row, or k <= 160 on an AVX-512 build: the stream, cut many times on
    long rows) also order equal scores by index; the heap (long rows, larger k) keeps the same
    set."""
    from retrieval.index.scan import _extension, topk_rows

    k = min(k, cols)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, cols), generator=g).float() - 1.0
    x[torch.rand(rows, cols, generator=g) < 0.3] = -0.0
    x[torch.rand(rows, cols, generator=g) < 0.1] = float("-inf")
    v, i = topk_rows(x, k)
    want_v, want_i = torch.sort(x, dim=1, descending=True, stable=True)
    want_v, want_i = want_v[:, :k], want_i[:, :k].masked_fill(want_v[:, :k] == float("-inf"), -1)
    assert torch.equal(v, want_v)
    if cols <= 16 * k or (k <= 160 and _extension().stream_select()):  # kRankSortMax
        assert torch.equal(i, want_i)
    else:
        assert torch.equal(i.sort(1).values, want_i.sort(1).values)


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("r", [100, 2000])  # the heap (many candidates a slot), the selection
def test_a_scan_floor_leaves_out_only_what_scores_below_it(catalog, filtered, r):
    """A second round's floor: the scan returns exactly the candidates it returns without one
    that score at or above the floor (ties at it kept), best first, -1 / -inf after them."""
    index = build_ivf(
        catalog["x"], IVFConfig(nlist=64), item_attributes=catalog["attrs"],
        attribute_values=catalog["values"],
    )  # fmt: skip
    q = catalog["q"][:40]
    fb = index.compile_filter("shard in {0, 1}" if filtered else None, len(q))
    coarse, lists = index.probe(q, 16)
    held = index.tensors().lists
    rows = ScanRows(q.contiguous(), lists, coarse, fb.masks.contiguous(), fb.negate.contiguous())
    pos, s = scan(held, rows, r)
    floor = s[:, r // 2].clone()  # a mid-result score per row
    floor[::3] = s[::3, 5]
    fpos, fs = scan(held, replace(rows, floor=floor), r)
    for row in range(len(q)):
        kept = int((s[row] >= floor[row]).sum())
        assert torch.equal(fpos[row, :kept], pos[row, :kept])
        assert torch.equal(fs[row, :kept], s[row, :kept])
        assert bool((fpos[row, kept:] == -1).all()) and bool(torch.isinf(fs[row, kept:]).all())


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 500),
    shape=st.tuples(st.integers(0, 40), st.integers(1, 300)),
    seed=st.integers(0, 999),
)
def test_positions_map_to_item_ids_and_pads_stay(n, shape, seed):
    """The C++ map of positions to item ids: ``item_ids[pos]``, -1 pads kept as -1; a position
    past the catalog raises instead of reading past it."""
    from retrieval.index.scan import ids_of_positions_cpu

    g = torch.Generator().manual_seed(seed)
    item_ids = torch.randint(0, 2**40, (n,), generator=g)
    pos = torch.randint(-1, n, shape, generator=g)
    want = torch.where(pos >= 0, item_ids[pos.clamp(min=0)], pos)
    assert torch.equal(ids_of_positions_cpu(pos, item_ids), want)
    if pos.numel():
        pos.view(-1)[-1] = n
        with pytest.raises(RuntimeError, match="out of range"):
            ids_of_positions_cpu(pos, item_ids)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(64, 3000),
    k=st.integers(1, 8),
    levels=st.sampled_from([3, 50, 10_000]),
    seed=st.integers(0, 999),
)
def test_a_probes_few_top_lists_are_the_best_in_order(rows, cols, k, levels, seed):
    """k <= 8 of a long row (a probe's lists, the bound on the lanes' maxima): the best k by
    score, the lower index first at equal scores, -inf never. With few levels the bound lets too
    many through and the row takes the general selection: the same scores, and on an AVX2 build
    (the heap) the same set of indices."""
    from retrieval.index.scan import _extension, topk_rows

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, cols), generator=g).float()
    x[torch.rand(rows, cols, generator=g) < 0.2] = float("-inf")
    v, i = topk_rows(x, k)
    want_v, want_i = torch.sort(x, dim=1, descending=True, stable=True)
    want_v, want_i = want_v[:, :k], want_i[:, :k].masked_fill(want_v[:, :k] == float("-inf"), -1)
    assert torch.equal(v, want_v)
    if levels == 10_000 or cols <= 16 * k or _extension().stream_select():  # never the heap
        assert torch.equal(i, want_i)
    else:
        assert torch.equal(i.sort(1).values, want_i.sort(1).values)
