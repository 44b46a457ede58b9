"""Seen items excluded inside the scan (``retrieval/index/exclude.py``): the kernel, its torch
reference, the exact plan and the planner agree, and an excluded item never takes a slot."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.exclude import PAD, IdOrder, excluded_positions, is_excluded
from retrieval.index.scan import scan
from retrieval.index.tensors import ScanRows


@pytest.fixture(scope="module", params=["int8", "fp8"])
def index(request, catalog) -> IVFIndex:
    cfg = IVFConfig(nlist=128, nprobe=8, codes=request.param)
    return build_ivf(
        catalog["x"], cfg, item_attributes=catalog["attrs"], attribute_values=catalog["values"]
    )


def _seen(index: IVFIndex, q: torch.Tensor, s: int, seed: int = 0) -> torch.Tensor:
    """``[B, s]`` item ids: half each row's own best items (so exclusion matters), half
    random, with ``-1`` pads and an id the index does not hold."""
    g = torch.Generator().manual_seed(seed)
    best, _ = index.search(q, s)
    rand = torch.randint(0, index.ntotal, (q.shape[0], s), generator=g)
    seen = torch.cat([best[:, ::2], rand], dim=1)[:, :s].clone()
    seen[:, -1] = -1
    seen[0, -2] = 10**9  # not in the index: ignored
    return seen


@settings(max_examples=50, deadline=None)
@given(
    ids=st.lists(st.integers(0, 60), min_size=1, max_size=40, unique=True),
    excl=st.lists(st.lists(st.integers(-1, 70), max_size=12), min_size=1, max_size=4),
    data=st.data(),
)
def test_is_excluded_equals_the_all_pairs_compare(ids, excl, data):
    item_ids = torch.tensor(ids)
    order = IdOrder.of(item_ids)
    width = max(len(e) for e in excl)
    ex = torch.tensor([e + [-1] * (width - len(e)) for e in excl], dtype=torch.int64)
    rows = excluded_positions(order, ex)  # [B, S]
    assert bool((rows[:, 1:] >= rows[:, :-1]).all())  # ascending, PAD last
    pos = torch.tensor(
        data.draw(
            st.lists(
                st.lists(st.integers(-1, len(ids) - 1), min_size=5, max_size=5),
                min_size=len(excl),
                max_size=len(excl),
            )
        )
    )  # [B, 5] rows (-1: a pad)
    held = item_ids[pos.clamp(min=0)]  # the items at those rows
    want = (held.unsqueeze(2) == ex.unsqueeze(1)).any(dim=2) & (pos >= 0)
    assert torch.equal(is_excluded(pos, rows), want)
    held_count = (torch.isin(ex, item_ids) & (ex >= 0)).sum(dim=1)  # the rest pads
    assert torch.equal(rows.ne(PAD).sum(dim=1), held_count)


@pytest.mark.parametrize("batch", [1, 32])
def test_kernel_with_exclusions_equals_reference_and_skips_them(index, catalog, batch):
    q = catalog["q"][:batch]
    coarse, probes = (q @ index.centroids.T).topk(12, dim=1)
    fb = index.compile_filter("not bucket = 3", batch)
    seen = _seen(index, q, 60)
    excl = excluded_positions(index.id_order, seen)
    lists = index.tensors().lists
    rows = ScanRows(q, probes, coarse, fb.masks, fb.negate, excl)
    pos, sc = scan(lists, rows, 100)
    rpos, rsc = scan(lists, rows, 100, reference=True)
    torch.testing.assert_close(sc, rsc, rtol=1e-5, atol=1e-4)
    assert (pos == rpos).float().mean() > 0.99  # ties may swap
    assert not bool(is_excluded(pos, excl).any())
    # = the best 100 of a wider scan without exclusions, the excluded ones struck
    wide, _wsc = scan(lists, ScanRows(q, probes, coarse, fb.masks, fb.negate), 160)
    keep = ~is_excluded(wide, excl)
    for b in range(batch):
        assert torch.equal(pos[b], wide[b][keep[b]][:100])


@pytest.mark.parametrize("exact", [False, True])
def test_search_never_returns_an_excluded_item(index, catalog, exact):
    q = catalog["q"][:16]
    seen = _seen(index, q, 80, seed=1)
    text = "shard in {0,1,2,3,4,5,6,7}"
    fb = index.compile_filter(text, q.shape[0])
    fb = FilterBatch(fb.masks, fb.negate, seen)
    pos, _scores = index.search(q, 50, fb, nprobe=8, rerank=0, exact=exact, positions=True)
    ids = torch.where(pos >= 0, index.item_ids[pos.clamp(min=0)], pos)
    assert bool((ids >= 0).all())  # K unseen items remain: the result is full
    assert not bool((ids.unsqueeze(2) == seen.unsqueeze(1)).any())
    if exact:  # the exact plan: the best 50 eligible items once the seen ones are struck
        want, _ = index.search(q, 50 + seen.shape[1], text, nprobe=index.nlist)
        for b in range(q.shape[0]):
            rest = want[b][~torch.isin(want[b], seen[b])][:50]
            assert set(ids[b].tolist()) == set(rest.tolist())


def test_planner_probes_enough_lists_for_the_excluded_items(index, catalog):
    b = 4
    fb = index.schema.empty(b)
    seen = torch.full((b, 400), -1, dtype=torch.int64)
    seen[1] = torch.arange(400)  # row 1 excludes 400 items, the others none
    plan = index.plan(FilterBatch(fb.masks, fb.negate, seen), index.params(20, 2, 0))
    assert int(plan.nprobe[1]) > int(plan.nprobe[0]) == 2
    assert torch.equal(plan.nprobe[[0, 2, 3]], torch.full((3,), 2))


def test_bad_exclusions_are_refused(index, catalog):
    q = catalog["q"][:2]
    fb = index.compile_filter(None, 2)
    for bad, match in [
        (torch.zeros(3, 4, dtype=torch.int64), r"exclude: expected int64 item ids \[B=2"),
        (torch.zeros(2, 4), "exclude: expected int64"),
        (torch.full((2, 3), -2, dtype=torch.int64), "ids are >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            index.search(q, 5, FilterBatch(fb.masks, fb.negate, bad))


@settings(max_examples=200, deadline=None)
@given(
    ids=st.one_of(
        st.integers(1, 300).map(lambda n: list(range(n))),  # a contiguous catalog: the guess hits
        st.builds(
            lambda n, s, o: [o + s * i for i in range(n)],  # a shard's evenly spread ids
            st.integers(1, 200),
            st.integers(2, 9),
            st.integers(0, 5),
        ),
        st.lists(st.integers(0, 2**62), min_size=1, max_size=200, unique=True),  # far apart
        st.lists(  # clusters: the guess lands far off and the search gallops
            st.one_of(st.integers(0, 50), st.integers(10**12, 10**12 + 50)),
            min_size=1,
            max_size=100,
            unique=True,
        ),
    ),
    seed=st.integers(0, 2**16),
    asked=st.lists(st.integers(-1, 2**62), max_size=30),
)
def test_positions_find_every_held_id_and_only_those(ids, seed, asked):
    rows = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    item_ids = torch.tensor(ids)[rows]  # row -> id, in no particular order
    row_of = {int(i): r for r, i in enumerate(item_ids.tolist())}
    want_ids = asked + [ids[j % len(ids)] for j in range(0, 3 * len(ids), 7)]  # held ones too
    got = IdOrder.of(item_ids).positions(torch.tensor(want_ids, dtype=torch.int64), missing=-5)
    assert got.tolist() == [row_of.get(i, -5) for i in want_ids]
