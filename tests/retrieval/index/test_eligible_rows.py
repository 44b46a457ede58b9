"""The rows passing one filter in one C++ call (``scan.eligible_rows_cpu``): driven by the
postings of the filter's most selective clause, they must be exactly the rows the full
signature check admits, ascending, for any vocabulary, multi-valued attributes and negations.
So must the bit-sliced evaluation (``scan.sliced_mask_cpu`` / ``sliced_rows_cpu``)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.filters import FilterSchema, eligible
from retrieval.index.build import bit_index
from retrieval.index.scan import (
    bit_slices_cpu,
    eligible_rows_cpu,
    filter_mask,
    sliced_mask_cpu,
    sliced_rows_cpu,
)


def masks_of(schema: FilterSchema, clauses: list[tuple[int, list[int]]]) -> torch.Tensor:
    """``[C, W]`` int64 masks: clause c admits values ``values`` of attribute ``a{j}``."""
    bits = np.zeros((len(clauses), schema.num_words * 64), dtype=np.uint64)
    for c, (j, values) in enumerate(clauses):
        for v in values:
            bits[c, schema.bit_of[(f"a{j}", str(v))]] = 1
    words = (bits.reshape(len(clauses), -1, 64) << np.arange(64, dtype=np.uint64)).sum(
        axis=2, dtype=np.uint64
    )
    return torch.from_numpy(words.view(np.int64).copy())


@settings(max_examples=60, deadline=None)
@given(
    vocabs=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    multi=st.lists(st.booleans(), min_size=3, max_size=3),
    n=st.integers(1, 400),
    picks=st.lists(
        st.tuples(st.integers(0, 2), st.floats(0.0, 1.0), st.booleans()), min_size=0, max_size=3
    ),
    seed=st.integers(0, 99),
    nones=st.lists(st.tuples(st.integers(0, 2), st.floats(0.0, 1.0)), max_size=3),
)
def test_rows_from_postings_equal_the_full_check(vocabs, multi, n, picks, seed, nones):
    """``nones``: "or none of these values" parts of the first clauses (``fnone``: "a != x or
    b = y" on a multi-valued ``a``), which never drive."""
    rng = np.random.default_rng(seed)
    schema = FilterSchema(
        {f"a{j}": [str(v) for v in range(vocab)] for j, vocab in enumerate(vocabs)}
    )
    attrs = {
        f"a{j}": rng.random((n, vocab)) < 0.2 if multi[j] else rng.integers(0, vocab, n)
        for j, vocab in enumerate(vocabs)
    }
    sig = schema.signatures(attrs, n)
    counts, postings = bit_index(sig)
    clauses = []
    for j, share, _neg in picks:
        j %= len(vocabs)
        values = [v for v in range(vocabs[j]) if rng.random() < share] or [0]
        clauses.append((j, values))
    masks = (
        masks_of(schema, clauses)
        if clauses
        else torch.zeros(0, schema.num_words, dtype=torch.int64)
    )
    negate = torch.tensor([neg for _j, _s, neg in picks], dtype=torch.bool)
    parts = []
    for j, share in nones[: len(picks)]:
        j %= len(vocabs)
        parts.append((j, [v for v in range(vocabs[j]) if rng.random() < share] or [0]))
    fnone = None
    if parts:
        fnone = torch.zeros_like(masks)
        fnone[: len(parts)] = masks_of(schema, parts)
        negate[: len(parts)] = False  # a clause with a "none of" part is otherwise positive
    ok = eligible(sig, masks, negate, fnone)
    want = ok.nonzero().flatten()
    got = eligible_rows_cpu(sig, masks, negate, counts, postings, fnone)
    assert torch.equal(got, want)
    # without postings (an index saved before them): every row is checked, same answer
    none = torch.zeros(0, dtype=torch.int32)
    assert torch.equal(eligible_rows_cpu(sig, masks, negate, counts, none, fnone), want)
    assert torch.equal(filter_mask(sig, masks, negate, fnone), ok)
    # bit-sliced, 64 items a word (n not a multiple of 64 included)
    slices = bit_slices_cpu(sig)
    assert slices.shape == (schema.num_words * 64, (n + 63) // 64)
    assert torch.equal(sliced_mask_cpu(slices, masks, negate, n, fnone), ok)
    assert torch.equal(sliced_rows_cpu(slices, masks, negate, n, fnone), want)


def test_a_dense_filter_reads_the_bit_slices_and_follows_changes_to_the_signatures():
    """No clause narrows the catalog (each passes most items): ``eligible_positions`` answers
    from the full check, then, after a few such filters, from the bit slices, equal to it; after
    the signatures change in place the kept slices are dropped (never read stale) and rebuilt."""
    from retrieval.index import IVFConfig, build_ivf
    from retrieval.index.eligible_scan import _SLICES, SLICES_AFTER, eligible_positions

    rng = np.random.default_rng(3)
    n = 3000
    vocab = {"tag": [f"t{i}" for i in range(10)], "lang": ["a", "b", "c"]}
    idx = build_ivf(
        torch.randn(n, 8),
        IVFConfig(nlist=8, measure_costs=False),
        item_attributes={"tag": rng.random((n, 10)) < 0.5, "lang": rng.integers(0, 3, n)},
        attribute_values=vocab,
    )
    t = idx.tensors()
    fb = idx.compile_filter("tag in {t0, t1, t2} and (lang != c) and not tag = t9", 1)
    masks, negate = fb.masks[0], fb.negate[0]
    sig = t.lists.sig
    for change in range(2):
        want = eligible(sig, masks, negate).nonzero().flatten()
        for call in range(SLICES_AFTER + 1):
            assert torch.equal(eligible_positions(t, masks, negate), want)
            built = _SLICES.get(sig)[1] is not None
            assert built == (call + 1 >= SLICES_AFTER), (change, call)
        sig[: n // 2] = 0  # in place: half the items lose every value
        assert eligible(sig, masks, negate).nonzero().min() >= n // 2
