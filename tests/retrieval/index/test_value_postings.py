"""The postings of a hashed attribute's values (``csrc/ivf_scan/values.cpp``): each item listed
under its value's bucket (its position modulo ``16**b``); a filter naming values reads only
their buckets, on the C++ path and in torch alike, and answers what every signature's check
answers, for hand-written signatures too; a live update's new value lands in its bucket; an
index saved when the postings listed the key's top digit answers as it did."""

from __future__ import annotations

import functools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.filters import NUMERIC, bucket_digits, eligible
from retrieval.index import IVFConfig, build_ivf
from retrieval.index.build import bit_index
from retrieval.index.eligible_scan import eligible_positions, eligible_positions_torch, value_drive
from retrieval.index.update import add_items, set_signatures
from retrieval.live_updates import signatures

CREATORS = [f"c{i}" for i in range(5000)]
COLORS = ["red", "green", "blue"]
N = 3000
CFG = IVFConfig(nlist=4, nprobe=4, measure_costs=False)


@functools.cache
def built():
    rng = np.random.default_rng(5)
    creator = np.where(rng.random(N) < 0.3, rng.integers(0, 6, N) * 97, rng.integers(0, 5000, N))
    attrs = {"creator": creator, "color": rng.integers(0, 3, N)}
    idx = build_ivf(
        torch.randn(N, 8),
        CFG,
        item_attributes=attrs,
        attribute_values={"creator": CREATORS, "color": COLORS},
    )
    return idx, attrs


def answers(idx, text: str) -> list[np.ndarray]:
    """The items ``text`` admits: every signature checked, the C++ path, the torch path."""
    t = idx.tensors()
    fb = idx.compile_filter(text, 1)
    nm = None if fb.neg_masks is None else fb.neg_masks[0]
    args = (t, fb.masks[0], fb.negate[0], nm)
    every = eligible(t.lists.sig, *args[1:]).nonzero().flatten()
    return [
        np.sort(p.numpy())
        for p in (every, eligible_positions(*args), eligible_positions_torch(*args))
    ]


def test_each_item_is_listed_under_its_values_bucket():
    idx, attrs = built()
    b = bucket_digits(4, N)
    assert idx.schema.hashed_digits == {"creator": 4} and b == 2
    assert idx.value_layout.tolist() == [[idx.schema.hashed_base["creator"], 4, b, 0]]
    offsets, postings = idx.value_offsets, idx.value_postings
    assert offsets.numel() == 16**b + 2 and postings.numel() == N  # the buckets, the overflow
    held = attrs["creator"][idx.item_ids.numpy()]  # by row
    for bucket in (0, 5, 97 % 256, 255):
        rows = postings[offsets[bucket] : offsets[bucket + 1]].numpy()
        np.testing.assert_array_equal(rows, np.flatnonzero(held % 16**b == bucket))
    assert int(offsets[-1] - offsets[-2]) == 0  # no hand-written signature: no overflow


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([0, 97, 194, 4999, 1234, 2500, 7]), min_size=1, max_size=5),
    st.sampled_from(["", " and color = red", " and color != green", " or color = blue"]),
)
def test_filters_naming_values_drive_from_their_buckets(values, rest):
    idx, attrs = built()
    names = ", ".join(f"c{v}" for v in values)
    text = f"(creator in {{{names}}}){rest}"
    every, cpp, torch_way = answers(idx, text)
    np.testing.assert_array_equal(cpp, every, err_msg=text)
    np.testing.assert_array_equal(torch_way, every, err_msg=text)
    fb = idx.compile_filter(text, 1)
    drive = value_drive(idx.tensors(), fb.masks[0], fb.negate[0])
    if rest.startswith(" or"):  # the creator's clauses carry a color bit: they do not drive
        assert drive is None
        return
    assert drive is not None
    held = attrs["creator"]
    buckets = {v % 256 for v in values}
    assert drive[0] == int(np.isin(held % 256, list(buckets)).sum())  # only their buckets
    assert drive[0] < N // 4


def test_a_not_in_never_drives_and_answers_alike():
    idx, _ = built()
    for text in ("creator != c97", "creator not in {c0, c97} and color = red"):
        every, cpp, torch_way = answers(idx, text)
        np.testing.assert_array_equal(cpp, every, err_msg=text)
        np.testing.assert_array_equal(torch_way, every, err_msg=text)
        fb = idx.compile_filter(text, 1)
        assert value_drive(idx.tensors(), fb.masks[0], fb.negate[0]) is None


def test_hand_written_signatures_are_never_missed():
    """Signatures an update wrote by hand: two bits in a bucket digit, or one digit empty,
    go to the overflow slot, which every filter driven by the values reads too."""
    idx, attrs = built()
    base = idx.schema.hashed_base["creator"]
    words = idx.sig[:3].numpy().view(np.uint64).copy()
    top = base + 3 * 16  # the key's top digit: the position's lowest
    word, at = top // 64, np.uint64(top % 64)
    words[0, word] |= np.uint64(1 << 9) << at  # two values' top digits at once
    words[1, word] &= ~(np.uint64(0xFFFF) << at)  # no top digit, the others kept
    words[2] = 0  # no value at all: listed nowhere
    sig = torch.from_numpy(words.view(np.int64))
    ids = idx.item_ids[:3]
    changed = set_signatures(idx, ids, sig)
    offsets = changed.value_offsets
    assert int(offsets[-1] - offsets[-2]) == 2  # the first two in the overflow
    assert changed.value_postings.numel() == N - 1
    held = int(attrs["creator"][int(ids[0])])
    also = held - held % 16 + 9  # the value its extra top digit makes it pass for
    for v in [*range(16), also]:
        text = f"creator in {{c{v}, c{v + 16}, c{v + 256}}}"  # two of one bucket
        every, cpp, torch_way = answers(changed, text)
        np.testing.assert_array_equal(cpp, every, err_msg=text)
        np.testing.assert_array_equal(torch_way, every, err_msg=text)
    row = int(changed.tensors().id_order.positions(ids[:1])[0])
    assert row in answers(changed, f"creator = c{also}")[1].tolist()  # read from the overflow


def test_a_new_value_lands_in_its_bucket():
    """An update naming a creator no item had (it takes the next position): the values'
    postings are made again from the signatures, so its item is found through its bucket."""
    idx, _ = built()
    schema = idx.schema
    sizes = schema.hashed_sizes()
    sig = signatures(schema, [{"creator": ["newcomer"], "color": ["red"]}])
    try:
        grown = add_items(idx, torch.tensor([N + 5]), torch.randn(1, 8), sig)
        position = schema.position["creator"]["newcomer"]
        assert position == 5000
        bucket = position % 256
        rows = grown.value_postings[grown.value_offsets[bucket] : grown.value_offsets[bucket + 1]]
        assert int(grown.tensors().id_order.positions(torch.tensor([N + 5]))[0]) in rows.tolist()
        every, cpp, torch_way = answers(grown, "creator = newcomer")
        assert grown.item_ids[cpp].tolist() == [N + 5]
        np.testing.assert_array_equal(torch_way, every)
    finally:
        schema.forget(sizes)


def test_an_index_that_listed_the_top_digit_answers_as_it_did():
    """Postings as indexes saved before the values' postings hold them (the key's top digit
    listed): that digit counts again, and every answer is unchanged."""
    idx, _ = built()
    old = type(idx)(
        idx.config, idx.dim, idx.schema.attribute_values, idx.stats, idx.schema.hashed_digits
    )
    old.load_state_dict(idx.state_dict())
    old.bit_counts, old.postings = bit_index(old.sig, old.schema.unindexed_bits(True))
    old._refresh()
    counts = old.tensors().posting_counts
    top = old.schema.hashed_base["creator"] + 3 * 16
    assert bool((counts[top : top + 16] >= 0).all()) and bool((counts[:top] < 0).any())
    for text in ("creator = c97", "creator in {c0, c4999} and color = red"):
        every, cpp, torch_way = answers(old, text)
        np.testing.assert_array_equal(cpp, every, err_msg=text)
        np.testing.assert_array_equal(torch_way, every, err_msg=text)


def test_a_build_measuring_costs_with_the_creator_past_the_first_word():
    """The build's cost calibration searches a copy whose signatures are one bit a row: the
    values' postings, laid out for the schema's words, are not read there (they would name bits
    past its one word); the built index then drives by them."""
    rng = np.random.default_rng(0)
    attrs = {"price": rng.normal(10, 5, 2000), "creator": rng.integers(0, 5000, 2000)}
    attrs["creator"][:3] = 7
    idx = build_ivf(
        torch.randn(2000, 8),
        IVFConfig(nlist=8, nprobe=2),
        item_attributes=attrs,
        attribute_values={"price": NUMERIC, "creator": CREATORS},
    )
    assert idx.stats.plan_costs and idx.schema.hashed_base["creator"] == 128
    want = set(np.flatnonzero(attrs["creator"] == 7).tolist())
    ids, _ = idx.search(torch.randn(1, 8), 5, "creator = c7", exact=True)
    assert {i for i in ids[0].tolist() if i >= 0} == want and len(want) >= 3
    fb = idx.compile_filter("creator = c7", 1)
    assert value_drive(idx.tensors(), fb.masks[0], fb.negate[0]) is not None
