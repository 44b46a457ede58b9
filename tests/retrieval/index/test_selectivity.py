"""The planner's estimate of a filter's share (``retrieval/index/selectivity.py``): the bit counts'
independent estimate held to what a sample of signatures admits, on the host and the device
alike, kept by a router's statistics and through a live update; and what it is for, the recall
of an AND whose clauses rarely meet."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrieval.filters import FilterSchema, eligible
from retrieval.index import IVFConfig, build_ivf, exact_search
from retrieval.index.build import bit_index
from retrieval.index.exact import recall_at_k
from retrieval.index.selectivity import (
    SAMPLE_ITEMS,
    estimate,
    estimate_device,
    sample_of,
    sample_rows,
)
from retrieval.index.split import split_index

VALUES = {
    "a": ["x", "y"],
    "b": ["x", "y"],
    "tag": ["t0", "t1", "t2"],
    "language": ["en", "fr", "de", "es"],
}
TEXTS = [
    "language in {en, fr}",
    "a = x and b = x",  # the anti-correlated pair: ~0.5 % where independence reads ~25 %
    "a = x or b = x",
    "(a = x and b = x) or language = de",
    "tag != t1 or a = y",  # a clause with a "none of" part
    "not (a = y) and language != es",
]


def items(n: int, seed: int = 0, overlap: float = 0.01) -> dict[str, np.ndarray]:
    """``a = x`` and ``b = x`` each on about half the items, on the same item only for
    ``overlap`` of them; tags multi-valued; language single-valued and independent."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 2, n)
    both = rng.random(n) < overlap
    b = np.where(both, a, 1 - a)  # b = x where a = y, but for the overlap
    return {
        "a": a,
        "b": b,
        "tag": rng.random((n, 3)) < 0.3,
        "language": rng.integers(0, 4, n),
    }


def share(schema: FilterSchema, sig: torch.Tensor, text: str) -> float:
    fb = schema.compile([text])
    nm = None if fb.neg_masks is None else fb.neg_masks[0]
    return float(eligible(sig, fb.masks[0], fb.negate[0], nm).float().mean())


@pytest.fixture(scope="module")
def catalog():
    n = 100_000
    schema = FilterSchema(VALUES)
    sig = schema.signatures(items(n), n)
    counts = bit_index(sig)[0]
    sample = sample_of(sig[sample_rows(n)], n)
    return schema, sig, counts, sample


def test_sample_rows_spread_over_the_catalog():
    assert sample_rows(10).tolist() == list(range(10))  # a small catalog: all of it
    rows = sample_rows(1_000_000)
    assert rows.numel() == SAMPLE_ITEMS and int(rows[0]) == 0 and int(rows[-1]) < 1_000_000
    gaps = rows.diff()
    assert int(gaps.min()) >= 244 and int(gaps.max()) <= 245  # evenly spaced


def test_independent_estimate_misreads_what_the_sample_reads(catalog):
    schema, sig, counts, sample = catalog
    n = sig.shape[0]
    empty = sample_of(sig[:0], n)  # no sample: the clauses taken as independent
    fb = schema.compile(["a = x and b = x"])
    truth = share(schema, sig, "a = x and b = x")
    independent = float(estimate(empty, counts, n, fb)[0])
    sampled = float(estimate(sample, counts, n, fb)[0])
    assert independent > 20 * truth  # ~25 % against ~0.5 %
    assert truth / 2 <= sampled <= truth * 2, (sampled, truth)


@pytest.mark.parametrize("text", TEXTS)
def test_estimate_is_near_the_share_for_every_expression(catalog, text):
    schema, sig, counts, sample = catalog
    n = sig.shape[0]
    truth = share(schema, sig, text)
    est = float(estimate(sample, counts, n, schema.compile([text]))[0])
    # within 3 standard errors of the sample share, a floor of the rare filter's allowance
    err = 3 * (truth * (1 - truth) / SAMPLE_ITEMS) ** 0.5 + 4 / SAMPLE_ITEMS
    assert abs(est - truth) <= err, (text, est, truth)


def test_a_catalog_sampled_whole_estimates_exactly():
    n = 3000  # fewer than SAMPLE_ITEMS: every item is in the sample
    schema = FilterSchema(VALUES)
    sig = schema.signatures(items(n, seed=1), n)
    sample = sample_of(sig[sample_rows(n)], n)
    for text in TEXTS:
        est = float(estimate(sample, bit_index(sig)[0], n, schema.compile([text]))[0])
        assert est == pytest.approx(share(schema, sig, text), abs=1e-6), text


def test_single_valued_clauses_read_their_exact_share_without_a_sample(catalog):
    schema, sig, counts, _ = catalog
    n = sig.shape[0]
    fb = schema.compile(["language in {en, fr}"])
    est = float(estimate(sample_of(sig[:0], n), counts, n, fb)[0])
    assert est == pytest.approx(share(schema, sig, "language in {en, fr}"))


def test_the_device_estimate_is_the_hosts(catalog):
    schema, sig, counts, sample = catalog
    n = sig.shape[0]
    fb = schema.compile(TEXTS)  # one batch, rows of every shape ("none of" parts included)
    host = estimate(sample, counts, n, fb)
    dev = estimate_device(sample, counts, n, fb.masks, fb.negate, fb.neg_masks)
    torch.testing.assert_close(dev, host)
    plain = schema.compile(TEXTS[:4])  # no "none of" part: the batch carries none
    assert plain.neg_masks is None
    host = estimate(sample, counts, n, plain)
    torch.testing.assert_close(estimate_device(sample, counts, n, plain.masks, plain.negate), host)


@pytest.fixture(scope="module")
def anti():
    """20k items in 64 clusters; ``a = x and b = x`` admits ~1 % of them, spread over all."""
    n, d = 20_000, 16
    rng = np.random.default_rng(3)
    centres = rng.standard_normal((64, d)).astype(np.float32) * 3
    x = centres[rng.integers(0, 64, n)] + rng.standard_normal((n, d)).astype(np.float32)
    q = torch.from_numpy(centres[rng.integers(0, 64, 50)] + rng.standard_normal((50, d)))
    attrs = items(n, seed=4, overlap=0.02)
    cfg = IVFConfig(nlist=64, nprobe=2, filter_bound=0)  # the first round alone: no second
    # (``bound.py``) to make up for a misread share (with the independent estimate: recall 0.94)
    index = build_ivf(torch.from_numpy(x), cfg, item_attributes=attrs, attribute_values=VALUES)
    keep = np.flatnonzero((attrs["a"] == 0) & (attrs["b"] == 0))
    truth, _ = exact_search(torch.from_numpy(x[keep]), q.float(), 20)
    return index, q.float(), torch.from_numpy(keep)[truth]


def test_an_and_of_clauses_that_rarely_meet_keeps_its_recall(anti):
    """The independent estimate (~25 %) would probe 5 lists for a filter ~1 % of each list
    passes (recall 0.94); the sample's reads its share, and the plan scans enough."""
    index, q, truth = anti
    ids, _ = index.search(q, 20, "a = x and b = x")
    assert recall_at_k(ids, truth) >= 0.95
    t = index.tensors()
    est = float(
        estimate(
            t.filter_sample, t.bit_counts, t.ntotal, index.compile_filter("a = x and b = x", 1)
        )[0]
    )
    assert est < 0.05  # ~1 %: the sample's, not the clauses' product


def test_the_router_plans_from_the_whole_catalogs_sample(anti):
    index, q, _ = anti
    stats, shards = split_index(index, torch.arange(index.ntotal) % 3, 3)
    assert torch.equal(stats.filter_sample, index.filter_sample)
    fb = index.compile_filter("a = x and b = x", q.shape[0])
    params = index.params(20)
    whole, routed = (
        index.plan(fb, params, q),
        stats.plan(stats.compile_filter("a = x and b = x", q.shape[0]), params, q),
    )
    assert torch.equal(whole.nprobe, routed.nprobe) and torch.equal(whole.kind, routed.kind)
    assert all(s.filter_sample.shape[0] == min(s.ntotal, SAMPLE_ITEMS) for s in shards)


def test_a_live_update_reads_the_sample_again(anti):
    from retrieval.index.update import set_signatures, signatures_of

    index, _, _ = anti
    ids = index.item_ids[sample_rows(index.ntotal)][:200]
    sig = signatures_of(index, ids)
    flipped = set_signatures(index, ids, torch.zeros_like(sig))  # no attribute at all
    rows = sample_rows(flipped.ntotal)
    assert torch.equal(flipped.filter_sample, flipped.sig[rows])
    assert not torch.equal(flipped.filter_sample, index.filter_sample)
