"""bench/filters_silvertorch*.py: the pieces around SilverTorch's ops that are ours — the exact
verification, the documents as our attributes, the mask packed in its fused op's bit order —
and, where SilverTorch is built (``SILVERTORCH_PATH``), its Bloom index built a whole number of
bundles at a time equal to the index built at once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from filters_silvertorch import (
    BUNDLE_DOCS,
    bloom_index,
    documents,
    load_silvertorch,
    passes,
    present_values,
    queries,
    reference,
)
from filters_silvertorch_topk import pack_lsb


def test_documents_hold_distinct_sorted_values() -> None:
    docs = documents(3000, 4, 10, 5)  # [N, F, per_doc] int8
    assert docs.dtype == np.int8 and docs.shape == (3000, 4, 5)
    assert (np.diff(docs.astype(int), axis=-1) > 0).all()


def test_verification_and_attributes_agree_with_the_reference() -> None:
    docs = documents(5000, 10, 10, 5)
    vals = torch.from_numpy(docs)
    attrs, vocab = present_values(docs, 10)
    assert vocab["f3"][7] == "v7" and attrs["f3"].sum(axis=1).tolist() == [5] * 5000
    for q in (queries(10, 10, 10, 5), queries(4, 10, 10, 5, per_group=1)):
        truth = reference(docs, q)
        keep = passes(vals, torch.arange(5000), q, 10)
        assert np.array_equal(keep.nonzero().flatten().numpy(), truth)
        f, vs = q[0]
        assert np.array_equal(attrs[f"f{f}"][truth][:, vs].any(axis=1), np.ones(len(truth), bool))


def test_pack_lsb_puts_document_j_at_bit_j_mod_64() -> None:
    n = 200
    mask = torch.zeros(256, dtype=torch.bool)
    on = [0, 5, 63, 64, 130, 199]
    mask[on] = True
    mask[n:] = True  # past the documents: never packed
    words = pack_lsb(mask, n)  # [1, 4]
    assert words.shape == (1, 4)
    got = [w * 64 + b for w in range(4) for b in range(64) if (int(words[0, w]) >> b) & 1]
    assert got == on


@pytest.mark.skipif("SILVERTORCH_PATH" not in os.environ, reason="SilverTorch is not built here")
def test_bloom_index_built_in_bundles_equals_built_at_once() -> None:
    loaded, why = load_silvertorch(Path(os.environ["SILVERTORCH_PATH"]))
    assert loaded, why
    docs = documents(3 * BUNDLE_DOCS + 77, 10, 10, 5)
    chunked = bloom_index(docs, 2.0, 5, chunk=BUNDLE_DOCS)
    flat = torch.from_numpy(docs.reshape(-1)).long() + 1
    offsets = torch.arange(0, flat.numel() + 1, 5, dtype=torch.int64)
    feature_ids = torch.arange(1, 11, dtype=torch.int32)
    once = torch.ops.st.bloom_index_build(feature_ids, offsets, flat, 2.0, 5)
    assert torch.equal(chunked[0], once[0]) and torch.equal(chunked[1], once[1])


@pytest.mark.skipif("SILVERTORCH_PATH" not in os.environ, reason="SilverTorch is not built here")
def test_its_fused_op_scores_exactly_the_documents_the_packed_mask_keeps() -> None:
    loaded, why = load_silvertorch(Path(os.environ["SILVERTORCH_PATH"]))
    assert loaded, why
    n, d = 300, 16
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(n, generator=g) < 0.3
    codes = torch.randint(-127, 128, (n, d), dtype=torch.int8, generator=g)
    q8 = torch.randint(-127, 128, (2, d), dtype=torch.int8, generator=g)
    offsets = torch.tensor([0, 100, 300])
    ids, lengths = torch.tensor([[0, 1], [1, 0]]), torch.tensor([[100, 200], [200, 100]])
    scores, rows = torch.ops.st.fused_kmean_ann(
        offsets, ids, lengths, codes, q8, n, pack_lsb(mask, n), -1, -1, torch.zeros(2).long()
    )
    for b in range(2):
        got = rows[b][rows[b] >= 0].long()
        assert sorted(got.tolist()) == mask.nonzero().flatten().tolist()
        want = (codes[got].int() * q8[b].int()).sum(dim=1)
        assert torch.equal(scores[b][: got.numel()], want)
