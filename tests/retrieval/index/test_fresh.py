"""The fresh segment beside the main index: upserts, removes and relabels in O(batch), searched
with the main lists and merged in one top-K. Oracle: the exact top-K over the items the updates
leave (their vectors and signatures), with the same filters and seen items."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.filters import FilterBatch, eligible
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index import live_index as live
from retrieval.index.compaction import fold, rebase
from retrieval.index.fresh import take_top_k
from retrieval.index.scan import KERNEL_ENV
from retrieval.index.search import Candidates

N, D = 1500, 16
VALUES = {"colour": ["red", "green", "blue"], "flag": ["false", "true"]}
FILTERS = [None, "colour = red", "not flag = true", "colour in {green, blue} and flag = true"]


def clustered(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(20, D, generator=torch.Generator().manual_seed(0)) * 3
    return c[torch.randint(0, 20, (n,), generator=g)] + torch.randn(n, D, generator=g)


@pytest.fixture(scope="module", params=["float32", "none"])
def built(request) -> tuple[IVFIndex, torch.Tensor, np.ndarray]:
    x = clustered(N, 1)
    rng = np.random.default_rng(2)
    attrs = {"colour": rng.integers(0, 3, N), "flag": rng.integers(0, 2, N)}
    rerank = 40 if request.param != "none" else 0
    cfg = IVFConfig(nlist=24, nprobe=6, exact_copy=request.param, rerank=rerank)
    index = build_ivf(x, cfg, item_attributes=attrs, attribute_values=VALUES)
    return index, x, index.sig[torch.argsort(index.item_ids)].clone()


class Catalog:
    """What the updates leave: id -> (vector, signature), the oracle's items."""

    def __init__(self, index: IVFIndex, x: torch.Tensor, sig: torch.Tensor):
        order = torch.argsort(index.item_ids)
        vec = index.vectors_at(order)  # as the index scores them (decoded, without a copy)
        # an index without an exact copy scores many queries with the query quantized too
        self.tol = 1e-5 if index.tensors().exact.shape[0] else 5e-3
        self.items = {i: (vec[i], sig[i]) for i in range(N)}

    def search(self, q: torch.Tensor, k: int, fb: FilterBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(sorted(self.items))
        vec = torch.stack([self.items[i][0] for i in ids.tolist()])
        sig = torch.stack([self.items[i][1] for i in ids.tolist()])
        scores = q @ vec.T
        ok = eligible(sig, fb.masks, fb.negate)
        if fb.exclude is not None:
            ok &= ~(ids[None, :, None] == fb.exclude[:, None, :]).any(-1)
        top, idx = scores.masked_fill(~ok, float("-inf")).topk(k, dim=1)
        return torch.where(top > float("-inf"), ids[idx], -1), top


def random_updates(
    index: IVFIndex, cat: Catalog, seed: int, rounds: int = 6, first_id: int = N + 100
) -> IVFIndex:
    """Upserts (new ids from ``first_id``, and replacements), removes and relabels, applied to
    both."""
    g = torch.Generator().manual_seed(seed)
    next_id = first_id
    for _ in range(rounds):
        have = torch.tensor(sorted(cat.items))
        pick = have[torch.randperm(len(have), generator=g)[:30]]
        new = torch.arange(next_id, next_id + 10)
        next_id += 10
        ids = torch.cat([new, pick[:10]])
        vec = clustered(len(ids), int(torch.randint(0, 1 << 30, (1,), generator=g)))
        sig = torch.randint(0, 32, (len(ids), 1), generator=g)
        index = live.upsert(index, ids, vec, sig)
        stored = index.live.vectors[-len(ids) :]
        for j, i in enumerate(ids.tolist()):
            cat.items[i] = (stored[j], sig[j])
        gone = pick[10:20]
        index = live.remove(index, gone)
        for i in gone.tolist():
            del cat.items[i]
        flip = pick[20:30]
        fsig = torch.randint(0, 32, (len(flip), 1), generator=g)
        index = live.relabel(index, flip, fsig)
        for j, i in enumerate(flip.tolist()):
            cat.items[i] = (cat.items[i][0], fsig[j])
    return index


def check_exact(got: tuple, want: tuple, cat: Catalog, q: torch.Tensor) -> None:
    """Same scores, and every id found scores what it was reported at (ties may swap ids)."""
    torch.testing.assert_close(got[1], want[1], rtol=cat.tol, atol=cat.tol)
    for b in range(q.shape[0]):
        for i, s in zip(got[0][b].tolist(), got[1][b].tolist(), strict=True):
            if i >= 0:
                true = float(q[b] @ cat.items[i][0])
                assert abs(true - s) <= 10 * cat.tol * max(1.0, abs(true))


def queries(b: int, fb_index: IVFIndex, filters: str | None, seen: int) -> tuple:
    q = clustered(b, 99)
    fb = fb_index.compile_filter(filters, b)
    if seen:
        ids = torch.randint(0, N + 200, (b, seen), generator=torch.Generator().manual_seed(3))
        fb = FilterBatch(fb.masks, fb.negate, ids)
    return q, fb


@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("seen", [0, 40])
def test_main_and_fresh_equal_the_exact_top_k_of_what_the_updates_leave(built, filters, seen):
    index, x, sig = built
    cat = Catalog(index, x, sig)
    updated = random_updates(index, cat, seed=5)
    q, fb = queries(12, updated, filters, seen)
    got = updated.search(q, 20, fb, exact=True)
    check_exact(got, cat.search(q, 20, fb), cat, q)
    one = updated.search(q[:1], 20, fb.rows(torch.tensor([0])), exact=True)  # a one-call path
    check_exact(one, cat.search(q[:1], 20, fb.rows(torch.tensor([0]))), cat, q[:1])


def test_the_old_index_is_untouched_and_the_main_buffers_shared(built):
    index, x, sig = built
    cat = Catalog(index, x, sig)
    q, _ = queries(6, index, None, 0)
    before = index.search(q, 10, exact=True)
    updated = random_updates(index, cat, seed=7)
    after = index.search(q, 10, exact=True)
    assert torch.equal(before[0], after[0]) and index.live is None
    assert updated.codes.data_ptr() == index.codes.data_ptr()
    assert updated.sig.data_ptr() == index.sig.data_ptr()


@pytest.mark.parametrize("filters", [None, "colour = red"])
def test_approximate_searches_return_served_eligible_unseen_items(built, filters):
    index, x, sig = built
    cat = Catalog(index, x, sig)
    updated = random_updates(index, cat, seed=11)
    q, fb = queries(10, updated, filters, 30)
    ids, _ = updated.search(q, 15, fb)
    for b in range(q.shape[0]):
        for i in ids[b].tolist():
            if i < 0:
                continue
            assert i in cat.items
            assert i not in fb.exclude[b].tolist()
            one = FilterBatch(fb.masks[b : b + 1], fb.negate[b : b + 1])
            assert bool(eligible(cat.items[i][1].view(1, -1), one.masks, one.negate)[0, 0])
    # an upserted item is answerable at once: the best match of a query is found first
    v = 10 * clustered(1, 123)
    updated = live.upsert(updated, torch.tensor([N + 999]), v, torch.zeros(1, 1).long())
    got, _ = updated.search(v / 10, 1)
    assert int(got[0, 0]) == N + 999


def test_positions_read_back_fresh_rows(built):
    """The scoring head's path: positions (fresh rows after the main ones), ids and vectors."""
    index, x, sig = built
    cat = Catalog(index, x, sig)
    updated = random_updates(index, cat, seed=13)
    q, fb = queries(5, updated, None, 0)
    pos, scores = updated.search(q, 10, fb, positions=True, exact=True)
    ids = updated.ids_at(pos)
    want = updated.search(q, 10, fb, exact=True)
    torch.testing.assert_close(scores, want[1])
    vec = updated.vectors_at(pos.flatten()).view(5, 10, D)
    for b in range(5):
        for j, i in enumerate(ids[b].tolist()):
            torch.testing.assert_close(vec[b, j], cat.items[i][0].float())


def test_refusals_name_the_items(built):
    index = built[0]
    with pytest.raises(ValueError, match="ids: items not in the index: 99999"):
        live.remove(index, torch.tensor([99999]))
    removed = live.remove(index, torch.tensor([3]))
    with pytest.raises(ValueError, match="items not in the index: 3"):
        live.relabel(removed, torch.tensor([3]), torch.zeros(1, 1, dtype=torch.int64))
    assert live.served(removed) == N - 1 and live.served(index) == N


def test_a_sibling_of_an_abandoned_update_sees_none_of_its_rows(built):
    index = built[0]
    base = live.upsert(index, torch.tensor([N + 1]), torch.ones(1, D), torch.zeros(1, 1).long())
    live.upsert(base, torch.tensor([N + 2]), torch.ones(1, D), torch.zeros(1, 1).long())  # dropped
    other = live.upsert(base, torch.tensor([N + 3]), -torch.ones(1, D), torch.ones(1, 1).long())
    assert sorted(other.live.ids[other.live.alive].tolist()) == [N + 1, N + 3]
    assert base.live.n == 1


@pytest.mark.parametrize("filters,seen", [(None, 0), (None, 20), ("colour = red", 10)])
def test_the_triton_kernel_merges_fresh_rows_as_the_cpu_does(built, monkeypatch, filters, seen):
    """Whole approximate searches with the scan forced onto the Triton kernel (interpreted
    here) answer as the C++ kernel does, main and fresh merged."""
    index, x, sig = built
    cat = Catalog(index, x, sig)
    updated = random_updates(index, cat, seed=17, rounds=3)
    q, fb = queries(6, updated, filters, seen)
    want = updated.search(q, 12, fb)
    monkeypatch.setenv(KERNEL_ENV, "triton")
    got = updated.search(q, 12, fb)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    same = (got[0].unsqueeze(2) == want[0].unsqueeze(1)).any(2) | (want[0] < 0)
    assert float(same.float().mean()) > 0.99


# ---- compaction ------------------------------------------------------------------------------
def test_a_fold_answers_as_the_segment_it_folds(built):
    index, x, sig = built
    cat = Catalog(index, x, sig)
    updated = random_updates(index, cat, seed=19)
    folded = fold(updated)
    assert folded.live is None and folded.ntotal == live.served(updated) == len(cat.items)
    assert live.served_ids(folded).tolist() == sorted(cat.items)
    for filters, seen in [(None, 0), ("colour = red", 30), ("not flag = true", 0)]:
        q, fb = queries(8, folded, filters, seen)
        check_exact(folded.search(q, 20, fb, exact=True), cat.search(q, 20, fb), cat, q)


def test_updates_made_during_a_fold_are_rebased_onto_it(built):
    index, x, sig = built
    cat = Catalog(index, x, sig)
    base = random_updates(index, cat, seed=23, rounds=3)
    folded = fold(base)  # meanwhile, more updates land in base's segment:
    now = random_updates(base, cat, seed=29, rounds=3, first_id=N + 500)
    fresh_ids = base.live.ids[base.live.alive][:5]  # folded, then removed / relabelled
    now = live.remove(now, fresh_ids[:2][live.locate(now, fresh_ids[:2])])
    for i in fresh_ids[:2].tolist():
        cat.items.pop(i, None)
    rebased = rebase(folded, base.live, now)
    assert rebased is not None and live.served_ids(rebased).tolist() == sorted(cat.items)
    assert rebased.live.size < now.live.size
    for filters, seen in [(None, 0), ("colour = red", 30)]:
        q, fb = queries(8, rebased, filters, seen)
        check_exact(rebased.search(q, 20, fb, exact=True), cat.search(q, 20, fb), cat, q)
    assert rebase(folded, base.live, index) is None  # not a descendant: fold again


@given(
    st.integers(1, 4), st.integers(1, 12), st.integers(0, 12), st.integers(0, 2**16), st.booleans()
)
@settings(max_examples=60, deadline=None)
def test_the_one_top_k_of_main_and_fresh_is_the_top_k_of_their_union(b, k, w, seed, pads):
    """``take_top_k``: the best ``k`` of a one-call answer and fresh candidates, padded rows
    (``-1`` / ``-inf``) never chosen over an item, best first."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, k + w, generator=g)
    ids = torch.randperm(10 * (k + w), generator=g)[: k + w].expand(b, -1).clone()
    if pads:
        scores[:, ::3] = float("-inf")
        ids[:, ::3] = -1
    main = (ids[:, :k], scores[:, :k])
    fresh = Candidates(ids[:, k:], scores[:, k:], scores[:, k:])
    got_ids, got = take_top_k(main, fresh, k)
    want, at = scores.topk(k, dim=1)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_ids >= 0, want > float("-inf"))
    real = want > float("-inf")
    assert torch.equal(got_ids[real], ids.gather(1, at)[real])  # finite randn: no ties
