"""The bound check's merge of two rounds (``search.merge_rounds``): the CPU's one C++ pass
answers what the torch ops a GPU runs answer, key for key and score for score."""

from __future__ import annotations

import pytest
import torch

from retrieval.index.plan import RowKind, SearchPlan, every
from retrieval.index.search import Candidates, merge_rounds, merge_rounds_torch

K = 10


def _round(b: int, w: int, n: int, g: torch.Generator, rerank: bool, pads: int) -> Candidates:
    """``b`` rows of ``w`` candidates over ``n`` keys (distinct in a row), the last ``pads``
    columns of every other row ``-1`` / ``-inf``; a key's scores are the same in every row and
    round (as an item's are), distinct across keys."""
    keys = torch.stack([torch.randperm(n, generator=g)[:w] for _ in range(b)])
    gen = torch.Generator().manual_seed(n)  # the same tables in both rounds
    approx = torch.randperm(4 * n, generator=gen)[:n].float()[keys]
    scores = torch.randperm(4 * n, generator=gen)[:n].float()[keys] if rerank else approx
    c = Candidates(keys, approx, scores.clone())
    if pads:
        drop = torch.zeros(b, w, dtype=torch.bool)
        drop[::2, w - pads :] = True
        c = c._without(drop)
    return c


@pytest.mark.parametrize("rerank", [False, True])
@pytest.mark.parametrize("pads", [0, 7])
@pytest.mark.parametrize("alias", [False, True])
def test_the_cpu_merge_equals_the_torch_ops(rerank: bool, pads: int, alias: bool) -> None:
    g = torch.Generator().manual_seed(int(rerank) * 4 + pads + int(alias) * 2)
    b_all, r = 300, 3 * K if rerank else K  # rows past one parallel chunk (64)
    w1 = r
    # few keys: the rounds share many (a key met again is emptied)
    first = _round(b_all, w1, 60, g, rerank, pads)
    rows = torch.cat([torch.tensor([0, 3, 4, 9]), torch.arange(17, b_all, 2)])
    more = _round(rows.numel(), r, 60, g, rerank, pads)
    exact = torch.zeros(rows.numel(), dtype=torch.bool)
    exact[[1, 5]] = True
    plan = SearchPlan(k=K, r=r, nprobe=torch.ones(rows.numel(), dtype=torch.int64),
                      kind=every(rows.numel(), RowKind.LISTS), exact_rows=exact)  # fmt: skip

    def top0() -> Candidates:
        if alias:  # the first round is the top (a width of k)
            return Candidates(first.keys[:, :K].clone(), first.approx[:, :K].clone(),
                              first.scores[:, :K].clone())  # fmt: skip
        return Candidates.empty(b_all, K)

    want, got = top0(), top0()
    # aliased: the first round handed in is the top being written
    merge_rounds_torch(want, want if alias else first, rows, plan, more)
    merge_rounds(got, got if alias else first, rows, plan, more)
    assert torch.equal(got.keys, want.keys)
    assert torch.equal(got.scores, want.scores)
    valid = want.keys >= 0
    assert torch.equal(got.approx[valid], want.approx[valid])
