"""EASE and item-kNN: hand-checked small cases, EASE's optimality condition, the shared top-K."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.baselines import (
    ease_bytes,
    ease_weights,
    gram_of,
    itemknn_weights,
    recommend_items,
)
from retrieval.seen import SeenSets

# user 0 consumed items 0, 1; user 1 item 1; item 2 nobody
SEEN = SeenSets.of(np.array([0, 0, 1]), np.array([0, 1, 1]), num_users=2)
USERS = np.arange(2)


def test_gram_counts_co_occurrences():
    assert gram_of(SEEN, 3, chunk=1).tolist() == [[1, 1, 0], [1, 2, 0], [0, 0, 0]]


def test_ease_by_hand():
    # G + I = [[2, 1, 0], [1, 3, 0], [0, 0, 1]], P = its inverse: [[.6, -.2], [-.2, .4]] and 1
    w = ease_weights(gram_of(SEEN, 3), lam=1.0)
    expected = torch.tensor([[0.0, 0.5, 0.0], [1 / 3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(w, expected, atol=1e-6)
    recs = recommend_items(w, SEEN.indicator(USERS, 3), SEEN.rows(USERS), k=1)
    assert recs.tolist() == [[2], [0]]  # user 0: only item 2 is unseen; user 1: item 0 (1/3)


@given(
    st.integers(2, 8).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.tuples(st.integers(0, 9), st.integers(0, n - 1)), min_size=1, max_size=50),
            st.floats(0.1, 500.0),
        )
    )
)
@settings(max_examples=50, deadline=None)
def test_ease_solves_its_constrained_least_squares(case):
    """W minimises ||X - XW||^2 + lam ||W||^2 with diag(W) = 0: the gradient
    ``(G + lam I) W - G`` vanishes off the diagonal (the diagonal carries the constraint)."""
    n, events, lam = case
    seen = SeenSets.of(np.array([u for u, _ in events]), np.array([i for _, i in events]), 10)
    g = gram_of(seen, n)
    w = ease_weights(g, lam).double()
    grad = (g + lam * torch.eye(n, dtype=torch.float64)) @ w - g
    off = ~torch.eye(n, dtype=torch.bool)
    assert w.diagonal().abs().max() == 0
    assert grad[off].abs().max() <= 1e-4 * (1 + g.abs().max())


def test_ease_refuses_a_catalog_whose_inverse_does_not_fit():
    assert ease_bytes(1000) == 16_000_000
    with pytest.raises(ValueError, match=r"1000 x 1000 inverse .* max_bytes"):
        ease_weights(torch.zeros(1000, 1000), lam=1.0, max_bytes=ease_bytes(1000) - 1)
    with pytest.raises(ValueError, match="lam"):
        ease_weights(torch.zeros(3, 3), lam=0.0)


def test_itemknn_cosine_by_hand():
    # columns of X: item 0 = (1, 0), item 1 = (1, 1), item 2 = (0, 0)
    w = itemknn_weights(gram_of(SEEN, 3))
    c = 1 / np.sqrt(2)
    assert torch.allclose(w, torch.tensor([[0, c, 0], [c, 0, 0], [0, 0, 0]]).float())


def test_itemknn_keeps_each_columns_largest_neighbours():
    # three users: items 0,1 ; 0,2 ; 0,1,3 -> item 0 is most like item 1, then 2, 3
    seen = SeenSets.of(np.array([0, 0, 1, 1, 2, 2, 2]), np.array([0, 1, 0, 2, 0, 1, 3]), 3)
    full, one = itemknn_weights(gram_of(seen, 4)), itemknn_weights(gram_of(seen, 4), 1)
    for j in range(4):
        best = int(full[:, j].argmax())
        assert one[:, j].nonzero().flatten().tolist() == [best]
        assert one[best, j] == full[best, j]
    with pytest.raises(ValueError, match="neighbours"):
        itemknn_weights(gram_of(seen, 4), -1)


def test_recommend_excludes_pads_and_breaks_ties_by_id():
    w = torch.zeros(4, 4)
    profiles = torch.zeros(2, 4)
    exclude = torch.tensor([[2, -1, -1], [0, 1, 3]])
    recs = recommend_items(w, profiles, exclude, k=4)
    assert recs.tolist() == [[0, 1, 3, -1], [2, -1, -1, -1]]
    with pytest.raises(ValueError, match="k"):
        recommend_items(w, profiles, exclude, k=5)
    with pytest.raises(ValueError, match="weights"):
        recommend_items(torch.zeros(3, 3), profiles, exclude, k=1)


def test_catalog_coverage_counts_distinct_recommended_items():
    from retrieval.metrics import catalog_coverage

    recs = np.array([[0, 1, 5], [1, -1, 7]])
    assert catalog_coverage(recs, 10, 2) == 0.2  # {0, 1}
    assert catalog_coverage(recs, 10, 3) == 0.4  # {0, 1, 5, 7}
