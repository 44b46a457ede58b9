"""Each row probes the lists its items need by their sizes (``probe.lists_holding``): the rule
itself, and every backend that applies it (the one-call C++ search, the rounds of a plain
batch, document shards) answering alike."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.candidates import candidates
from retrieval.index.plan import SearchParams, SearchPlan, kinds
from retrieval.index.planner import FILL, lists_for
from retrieval.index.probe import lists_holding
from retrieval.index.search import Candidates, run_search
from retrieval.index.split import shard_of, split_index
from retrieval.index.update import remove_items
from serving.sharding.wire import decode_request, encode_request
from support.formats import unversioned
from support.topk_check import assert_same_topk
from tests.retrieval.index.reference import planned


def reference(lists: list[list[int]], sizes: list[int], least: list[int], hold: list[int]):
    """The rule as a loop: slot j stays while j < least or the slots before it hold < hold."""
    out = []
    for row, fewest, need in zip(lists, least, hold, strict=True):
        held, kept = 0, []
        for j, lst in enumerate(row):
            kept.append(lst if j < fewest or held < need else -1)
            held += sizes[lst] if lst >= 0 else 0
        out.append(kept)
    return out


@settings(max_examples=200, deadline=None)
@given(data=st.data(), b=st.integers(1, 5), p=st.integers(1, 6), nlist=st.integers(1, 9))
def test_the_rule_keeps_the_best_lists_until_they_hold_enough(data, b, p, nlist):
    lists = [
        data.draw(st.lists(st.integers(-1, nlist - 1), min_size=p, max_size=p)) for _ in range(b)
    ]
    sizes = data.draw(st.lists(st.integers(0, 50), min_size=nlist, max_size=nlist))
    least = data.draw(st.lists(st.integers(1, p), min_size=b, max_size=b))
    hold = data.draw(st.lists(st.integers(0, 200), min_size=b, max_size=b))
    got = lists_holding(
        torch.tensor(lists), torch.tensor(sizes), torch.tensor(least), torch.tensor(hold)
    )
    assert got.tolist() == reference(lists, sizes, least, hold)
    one = lists_holding(torch.tensor(lists), torch.tensor(sizes), least[0], torch.tensor(hold))
    assert one.tolist() == reference(lists, sizes, [least[0]] * b, hold)


@pytest.fixture(scope="module", params=["ip", "l2"])
def index(request, catalog) -> IVFIndex:
    """128 lists of ~156 items, nprobe 1: K = 100 plans 2 lists (2 x 100 items of average
    lists), and a row whose nearest list holds 200 or more probes one."""
    cfg = IVFConfig(nlist=128, nprobe=1, codes="int8", probe=request.param)
    return build_ivf(
        catalog["x"], cfg, item_attributes=catalog["attrs"], attribute_values=catalog["values"]
    )


def cut_rows(index: IVFIndex, q: torch.Tensor, k: int, excluded: int = 0) -> int:
    """Rows of ``q`` that probe fewer lists than the plan's count (the rule cut them)."""
    p = lists_for(index.tensors(), 1.0, 1, k + excluded)
    _, probes = index.probe(q, p)
    hold = torch.full((q.shape[0],), FILL * (k + excluded))
    kept = lists_holding(probes, index.built_sizes, 1, hold)
    return int(kept.lt(0).any(dim=1).sum())


def sharded(index: IVFIndex, q: torch.Tensor, k: int, fb: FilterBatch, shards: int = 3):
    """The router's loop in one process: plan on the statistics, each round through the wire,
    merge the shards' candidates."""
    stats, parts = split_index(index, shard_of(index.item_ids, shards), shards)
    plan = stats.plan(fb, SearchParams(k, 1), q=q)
    assert plan.least is not None  # the shards are told to cut

    def fetch(p: SearchPlan, rows):
        qq, f = (q, fb) if rows is None else (q[rows], fb.rows(rows))
        qq, f, p = decode_request(encode_request("m", 1, qq, f, p, with_vectors=False))
        return Candidates.concat([s.item_candidates(qq, f, p) for s in parts])

    top = run_search(plan, fetch)
    return top.keys, top.scores


@pytest.mark.parametrize("k", [100, 300])
@pytest.mark.parametrize("rows", [4, 64])  # the one-call C++ search; the batch's torch ops
def test_every_path_cuts_the_same_lists(index: IVFIndex, catalog, k: int, rows: int) -> None:
    q = catalog["q"][:rows]
    assert cut_rows(index, catalog["q"], k) > 0  # the rule is in play
    empty = index.compile_filter(None, rows)
    want_pos, scores = planned(index, q, k, empty, 1)
    plain = index.search(q, k, nprobe=1, positions=True)
    assert torch.equal(plain[0], want_pos)
    planned_ = want_pos
    want = index.item_ids[planned_]
    assert torch.equal(index.search(q, k, nprobe=1)[0], want)  # rows <= 16: one C++ call
    assert_same_topk(*sharded(index, q, k, empty), want, scores)  # ties in any order
    assert (planned_ >= 0).all()  # no row comes up short for it


def test_excluded_items_count_towards_what_a_row_holds(index: IVFIndex, catalog) -> None:
    q = catalog["q"][:8]
    seen = index.search(q, 150, nprobe=4)[0]  # each row's own best 150
    seen[::2, 75:] = -1  # rows excluding 150 and 75 items
    empty = index.compile_filter(None, len(q))
    fb = FilterBatch(empty.masks, empty.negate, exclude=seen)
    pos, scores = planned(index, q, 50, fb, 1)
    assert cut_rows(index, q[1::2], 50, 75) > 0 and (pos >= 0).all()
    assert not bool(torch.isin(index.item_ids[pos], seen).any())
    for row in range(len(q)):  # one row at a time: one list count, the C++ call
        one = FilterBatch(fb.masks[row : row + 1], fb.negate[row : row + 1], seen[row : row + 1])
        got = index.search(q[row : row + 1], 50, one, nprobe=1)
        assert torch.equal(got[0], index.item_ids[pos[row : row + 1]])
    assert_same_topk(*sharded(index, q, 50, fb), index.item_ids[pos], scores)


def test_a_row_without_a_clause_probes_as_alone_beside_filtered_rows(index, catalog) -> None:
    """A batch with a filtered row names every row's lists with the bound check
    (``bound.with_bounds``): the rows without a clause are cut there as they are alone. Costs by
    the constant model, so the filtered rows take lists whatever the build's timings."""
    index = build_ivf(
        catalog["x"],
        index.config.model_copy(update={"measure_costs": False}),
        item_attributes=catalog["attrs"],
        attribute_values=catalog["values"],
    )
    q = catalog["q"][:16]
    texts = ["not shard in {0,1}" if i % 2 else None for i in range(len(q))]
    fb = index.compile_filter(texts, len(q))
    plan = index.plan(fb, SearchParams(100, 1), q=q)
    assert plan.lists is not None and plan.check is not None  # the bound check named them
    p = lists_for(index.tensors(), 1.0, 1, 100)
    cut = lists_holding(index.probe(q[::2], p)[1], index.built_sizes, 1, torch.full((8,), 200))
    assert torch.equal(plan.lists[::2, :p], cut) and (plan.lists[::2, p:] < 0).all()
    mixed = index.search(q, 100, texts, nprobe=1)
    alone = index.search(q[::2], 100, nprobe=1)
    assert cut_rows(index, q[::2], 100) > 0
    assert torch.equal(mixed[0][::2], alone[0])
    torch.testing.assert_close(mixed[1][::2], alone[1], rtol=0, atol=0)


def test_lists_emptied_since_the_build_leave_no_row_short(index, catalog) -> None:
    """Sizes as built over-count a list that live updates thinned: a row cut to it alone comes
    up short, widens (every widened list, uncut) on every path, and still finds k items."""
    q = catalog["q"]
    _, probes = index.probe(q, lists_for(index.tensors(), 1.0, 1, 100))
    cut = lists_holding(probes, index.built_sizes, 1, torch.full((len(q),), FILL * 100))
    alone = (cut[:, 1:] < 0).all(dim=1).nonzero().flatten()[:4]  # rows cut to their first list
    assert alone.numel() > 0
    q, lists = q[alone], cut[alone, 0].unique()
    starts, ends = index.offsets[lists], index.offsets[lists + 1]
    rows = torch.cat([torch.arange(int(a), int(b) - 50) for a, b in zip(starts, ends, strict=True)])
    thinner = remove_items(index, index.item_ids[rows])  # 50 items left in each
    assert torch.equal(thinner.built_sizes, index.built_sizes)  # still the sizes as built
    empty = thinner.compile_filter(None, len(q))
    pos, scores = planned(thinner, q, 100, empty, 1)
    assert (pos >= 0).all()
    plain = thinner.search(q, 100, nprobe=1, positions=True)
    assert torch.equal(plain[0], pos)
    assert torch.equal(thinner.search(q, 100, nprobe=1)[0], thinner.item_ids[pos])
    assert_same_topk(*sharded(thinner, q, 100, empty), thinner.item_ids[pos], scores)


def test_an_index_saved_before_the_sizes_probes_every_planned_list(index, catalog) -> None:
    state = {k: v for k, v in unversioned(index.state_dict()).items() if k != "built_sizes"}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    old = IVFIndex(index.config, index.dim, index.schema.attribute_values)
    old.load_state_dict(torch.load(buf, weights_only=True))
    assert old.built_sizes.numel() == 0
    q, k = catalog["q"], 100
    empty = old.compile_filter(None, len(q))
    assert old.plan(empty, SearchParams(k, 1)).least is None
    p = lists_for(index.tensors(), 1.0, 1, k)  # every row: p lists, uncut
    every = SearchPlan(k, k, torch.full((len(q),), p), kinds(torch.zeros(len(q), dtype=torch.bool)))
    want = index.item_ids[select_top(index, q, every)]
    assert torch.equal(old.search(q, k, nprobe=1)[0], want)
    assert cut_rows(index, q, k) > 0  # where the index with its sizes probes fewer


def select_top(index: IVFIndex, q: torch.Tensor, plan: SearchPlan) -> torch.Tensor:
    return run_search(plan, lambda p, rows: candidates(index.tensors(), q, None, p)).keys


@pytest.mark.gpu
def test_the_graphed_plain_path_cuts_as_the_cpu_does(index: IVFIndex, catalog) -> None:
    q = catalog["q"]
    want = index.search(q, 100, nprobe=1)[0]
    gpu = build_ivf(catalog["x"], index.config).to("cuda")
    for _ in range(2):  # the capture, then a replay
        got = gpu.search(q.cuda(), 100, nprobe=1)[0].cpu()
        assert (got == want).float().mean() >= 0.99  # float sums in another order on a GPU
