"""The index's public edges (issue 21): NumPy arrays wherever tensors go, any integral count,
refusals that say what to write instead, and the count of lists a search probes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.inputs import as_count
from retrieval.index.update import add_items, remove_items, set_signatures, signatures_of


@pytest.fixture(scope="module")
def index(catalog) -> IVFIndex:
    cfg = IVFConfig(nlist=64, nprobe=4)
    return build_ivf(
        catalog["x"], cfg, item_attributes=catalog["attrs"], attribute_values=catalog["values"]
    )


def test_numpy_queries_vectors_and_ids_work_like_tensors(index, catalog):
    q = catalog["q"][:8]
    ids_t, s_t = index.search(q, 20, "shard in {1,2}")
    ids_n, s_n = index.search(q.numpy(), np.int64(20), "shard in {1,2}", nprobe=np.int32(4))
    assert torch.equal(ids_t, ids_n) and torch.equal(s_t, s_n)
    x = catalog["x"][:2000]
    ids = np.arange(1000, 3000)
    built_n = build_ivf(x.numpy(), IVFConfig(nlist=16), item_ids=ids)
    built_t = build_ivf(x, IVFConfig(nlist=16), item_ids=torch.from_numpy(ids))
    assert torch.equal(built_n.item_ids, built_t.item_ids)
    assert torch.equal(built_n.search(q, 5)[0], built_t.search(q, 5)[0])


@pytest.mark.parametrize("rows", [4, 40])  # the one-call C++ search; the batch's
@pytest.mark.parametrize("text", [None, "shard in {1,2}"])
def test_strided_queries_answer_as_their_contiguous_copy(index, catalog, rows, text):
    """A view of every other row, or a transposed copy, is searched as its contiguous copy (the
    one-call search once handed a strided view to a kernel that reads rows in place)."""
    q = catalog["q"]
    for view in (q[: 2 * rows : 2], q[:rows].T.contiguous().T):
        assert not view.is_contiguous()
        got, want = index.search(view, 10, text), index.search(view.contiguous(), 10, text)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_numpy_updates(index, catalog):
    new_ids = np.array([10**6, 10**6 + 1])
    vecs = catalog["q"][:2].numpy()
    sig = np.zeros((2, index.sig.shape[1]), dtype=np.int64)
    grown = add_items(index, new_ids, vecs, sig)
    assert grown.ntotal == index.ntotal + 2
    assert torch.equal(signatures_of(grown, new_ids), torch.from_numpy(sig))
    flipped = set_signatures(grown, new_ids[:1], np.full((1, sig.shape[1]), 1, dtype=np.int64))
    assert int(signatures_of(flipped, new_ids[:1])[0, 0]) == 1
    assert remove_items(grown, new_ids.astype(np.int32)).ntotal == index.ntotal


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(k=True), r"k: expected an integer >= 1, got True"),
        (dict(k=10.0), r"k: expected an integer"),
        (dict(k=0), r"k: expected an integer >= 1, got 0"),
        (dict(k=10**9), r"k: at most 20000 \(the catalog size\)"),
        (dict(nprobe=0), r"nprobe: .*got 0; leave it out \(None\) to probe the index's nprobe"),
        (dict(nprobe=False), r"nprobe: expected an integer >= 1, got False"),
        (dict(rerank=-1), r"rerank: expected an integer >= 0"),
        (dict(rerank=50), r'rerank=50: this index keeps no exact copy .*exact_copy="float16"'),
        (dict(q=[[0.0] * 32]), r"q: expected a torch.Tensor or numpy.ndarray, got list"),
        (dict(q=np.zeros((2, 32), dtype=np.int64)), r"q: expected floats \[B, 32\].*astype"),
        (dict(q=np.zeros((2, 31), dtype=np.float32)), r"q: expected floats \[B, 32\]"),
    ],
)
def test_bad_arguments_say_what_to_write(index, catalog, kwargs, match):
    args = dict(q=catalog["q"][:2], k=10) | kwargs
    q, k = args.pop("q"), args.pop("k")
    with pytest.raises(ValueError, match=match):
        index.search(q, k, **args)


@settings(max_examples=50, deadline=None)
@given(
    st.one_of(
        st.integers(-5, 50),
        st.integers(-5, 50).map(np.int64),
        st.integers(0, 50).map(np.uint16),
        st.booleans(),
        st.floats(-5, 50),
    )
)
def test_as_count_takes_integrals_and_refuses_the_rest(value):
    integral = isinstance(value, int | np.integer) and not isinstance(value, bool)
    if integral and int(value) >= 1:
        out = as_count(value, "k", 1)
        assert out == int(value) and type(out) is int
    else:
        with pytest.raises(ValueError, match="k: expected an integer >= 1"):
            as_count(value, "k", 1)


def test_search_plan_shows_the_lists_probed(index):
    plain = index.search_plan(10)
    assert plain.nprobe.tolist() == [4] and not bool(plain.exact.any())
    assert int(index.search_plan(10, nprobe=np.int64(8)).nprobe[0]) == 8
    # a selective filter widens the probe (nprobe is a lower bound, and the plan says by how much)
    narrow = index.search_plan(10, ["shard in {1,2,3,4,5,6,7,8}", None], nprobe=4)
    assert narrow.nprobe.shape == (2,)
    assert int(narrow.nprobe[0]) > 4 and int(narrow.nprobe[1]) == 4
    # a k larger than the probed lists hold widens it too
    assert int(index.search_plan(5000, nprobe=4).nprobe[0]) > 4
    assert index.search_plan(10, "shard = 1", batch=3).nprobe.shape == (3,)


def test_kept_settings_follow_the_config_and_still_refuse_what_equals_them(catalog):
    """A search checks ``(k, nprobe, rerank)`` once and keeps them until the index changes: a
    new config's nprobe applies to the next search that leaves nprobe out, and ``True`` (which
    equals 1, the key of a kept setting) is still refused."""
    index = build_ivf(catalog["x"][:4000], IVFConfig(nlist=32, nprobe=1, measure_costs=False))
    q = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))  # between the clusters
    rows = [q[i : i + 1] for i in range(len(q))]  # one query a call: the one-call search

    def ids(**kwargs) -> torch.Tensor:
        return torch.cat([index.search(row, 10, **kwargs)[0] for row in rows])

    before = ids()
    index.search(rows[0], 1, nprobe=1)
    with pytest.raises(ValueError, match="k: expected an integer >= 1, got True"):
        index.search(rows[0], True, nprobe=1)
    with pytest.raises(ValueError, match="nprobe: expected an integer >= 1, got True"):
        index.search(rows[0], 1, nprobe=True)
    index.config = index.config.model_copy(update={"nprobe": 8})
    after = ids()
    assert torch.equal(after, ids(nprobe=8)) and torch.equal(after, ids(nprobe=np.int64(8)))
    assert not torch.equal(before, after)  # nprobe 1 and 8 answer differently here
