"""The shard wire format (serving/sharding/wire.py): a plan's second-round lists and its lists by
size travel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.filters import FilterBatch
from retrieval.index import IVFConfig, build_ivf
from retrieval.index.plan import SearchParams, SearchPlan, kinds
from retrieval.index.search import Candidates, run_search
from retrieval.index.split import shard_of, split_index
from serving.sharding.wire import decode_request, encode_request
from support.topk_check import assert_same_topk


def request(lists: torch.Tensor | None):
    q = torch.randn(2, 4)
    fb = FilterBatch(torch.ones(2, 1, 1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.bool))
    plan = SearchPlan(3, 5, torch.tensor([2, 7]), kinds(torch.tensor([False, True])), lists)
    return encode_request("m", 1, q, fb, plan, with_vectors=False)


def test_lists_round_trip():
    lists = torch.tensor([[4, 9, -1], [0, -1, -1]])
    _, _, plan = decode_request(request(lists))
    assert plan.lists is not None and torch.equal(plan.lists, lists)
    _, _, plan = decode_request(request(None))
    assert plan.lists is None


def test_bad_lists_name_the_field():
    msg = request(torch.tensor([[4, -2], [0, 1]]))
    with pytest.raises(ValueError, match="lists"):
        decode_request(msg)
    msg.lists = msg.lists[:-4]
    with pytest.raises(ValueError, match="lists"):
        decode_request(msg)


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 4),
    d=st.integers(1, 6),
    c=st.integers(0, 3),
    w=st.integers(1, 2),
    list_width=st.integers(0, 3),
    exclude_width=st.integers(0, 3),
    floored=st.booleans(),
    holding=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_request_round_trips_with_every_field_its_dtype(
    b, d, c, w, list_width, exclude_width, floored, holding, seed
):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g)
    masks = torch.randint(-(2**62), 2**62, (b, c, w), generator=g)
    negate = torch.randint(0, 2, (b, c), generator=g).bool()
    exclude = torch.randint(-1, 10**12, (b, exclude_width), generator=g) if exclude_width else None
    lists = torch.randint(-1, 1000, (b, list_width), generator=g) if list_width else None
    nprobe = torch.randint(1, 50, (b,), generator=g)
    exact = torch.randint(0, 2, (b,), generator=g).bool()
    floor = torch.randn(b, generator=g) if floored else None
    if floor is not None:
        floor[0] = float("-inf")  # a row with nothing to beat yet
    least = hold = None
    if holding:
        least = (torch.rand(b, generator=g) * nprobe).long().clamp(min=1)
        hold = torch.randint(0, 10**6, (b,), generator=g)
    plan = SearchPlan(3, 5, nprobe, kinds(exact), lists, floor=floor, least=least, hold=hold)
    got_q, got_fb, got = decode_request(
        encode_request("m", 1, q, FilterBatch(masks, negate, exclude), plan, with_vectors=False)
    )
    assert torch.equal(got_q, q) and torch.equal(got_fb.masks, masks)
    assert torch.equal(got_fb.negate, negate) and got_fb.negate.dtype == torch.bool
    assert (got.k, got.r) == (3, 5) and torch.equal(got.nprobe, nprobe)
    assert torch.equal(got.exact, exact) and got.exact.dtype == torch.bool
    pairs = ((lists, got.lists), (exclude, got_fb.exclude), (least, got.least), (hold, got.hold))
    for sent, back in pairs:
        assert (back is None) == (sent is None)
        if sent is not None:
            assert back is not None and back.dtype == torch.int64 and torch.equal(back, sent)
    assert (got.floor is None) == (floor is None)
    if floor is not None:
        assert got.floor is not None and got.floor.dtype == torch.float32
        assert torch.equal(got.floor, floor)


def test_a_bad_floor_names_the_field():
    plan = SearchPlan(3, 5, torch.tensor([2, 2]), kinds(torch.zeros(2, dtype=torch.bool)))
    fb = FilterBatch(torch.zeros(2, 0, 1, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.bool))
    msg = encode_request("m", 1, torch.randn(2, 4), fb, plan, with_vectors=False)
    msg.floor = np.array([0.5, np.nan], np.float32).tobytes()
    with pytest.raises(ValueError, match="floor"):
        decode_request(msg)
    msg.floor = msg.floor[:4]
    with pytest.raises(ValueError, match="floor"):
        decode_request(msg)


def test_bad_list_holding_names_the_field():
    plan = SearchPlan(
        3, 5, torch.tensor([2, 4]), kinds(torch.zeros(2, dtype=torch.bool)),
        least=torch.tensor([1, 2]), hold=torch.tensor([10, 10]),
    )  # fmt: skip
    fb = FilterBatch(torch.zeros(2, 0, 1, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.bool))
    msg = encode_request("m", 1, torch.randn(2, 4), fb, plan, with_vectors=False)
    assert decode_request(msg)[2].least is not None
    for field, value in (("least", [1, 5]), ("least", [0, 2]), ("hold", [10, -1])):
        bad = type(msg)()
        bad.CopyFrom(msg)
        setattr(bad, field, np.array(value, np.int64).tobytes())
        with pytest.raises(ValueError, match=field):
            decode_request(bad)
    msg.hold = b""  # one without the other
    with pytest.raises(ValueError, match="hold"):
        decode_request(msg)


@pytest.mark.parametrize("field", ["exact", "filter_negate"])
def test_flags_other_than_0_or_1_name_their_field(field):
    """A bool tensor must not be built over bytes like 2 (torch would hold an invalid bool)."""
    msg = request(None)
    setattr(msg, field, b"\x01\x02")
    with pytest.raises(ValueError, match=f"{field}: every byte must be 0 or 1"):
        decode_request(msg)
    setattr(msg, field, b"\x01")
    with pytest.raises(ValueError, match=field):
        decode_request(msg)


@pytest.mark.parametrize(
    ("field", "value"), [("nprobe", torch.tensor([2, 0])), ("exclude", torch.tensor([[5], [-2]]))]
)
def test_out_of_range_values_name_their_field(field, value):
    q = torch.randn(2, 4)
    masks, negate = torch.ones(2, 1, 1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.bool)
    nprobe = value if field == "nprobe" else torch.tensor([2, 7])
    fb = FilterBatch(masks, negate, value if field == "exclude" else None)
    plan = SearchPlan(3, 5, nprobe, kinds(torch.tensor([False, True])), None)
    with pytest.raises(ValueError, match=field):
        decode_request(encode_request("m", 1, q, fb, plan, with_vectors=False))


def test_second_rounds_through_the_wire_send_their_floor_and_answer_as_unsharded(catalog):
    """The router's loop over two shards, every round's plan through the wire as the router
    sends it: rows whose bound check asks for more lists carry their K-th score so far
    (``SearchPlan.floor``), the shards' scans leave out what cannot reach it, and the merged
    answer is the unsharded index's."""
    index = build_ivf(
        catalog["x"],
        IVFConfig(nlist=64, nprobe=2, rerank=0, measure_costs=False),  # no timing decides
        item_attributes=catalog["attrs"],
        attribute_values=catalog["values"],
    )
    stats, shards = split_index(index, shard_of(index.item_ids, 2), 2)
    # k = 500 at nprobe 1: every row's first round leaves lists a bound says could beat it
    q, k, text = catalog["q"][:32], 500, "not shard in {0,1,2} and bucket != 5"
    fb = stats.compile_filter(text, q.shape[0])
    plan = stats.plan(fb, SearchParams(k, 1), q=q)
    floors: list[torch.Tensor] = []

    def fetch(p: SearchPlan, rows):
        qq, f = (q, fb) if rows is None else (q[rows], fb.rows(rows))
        sent_q, sent_fb, sent = decode_request(encode_request("m", 1, qq, f, p, False))
        if sent.floor is not None:
            floors.append(sent.floor)
        return Candidates.concat([s.item_candidates(sent_q, sent_fb, sent) for s in shards])

    top = run_search(plan, fetch)
    want_ids, want_scores = index.search(q, k, text, nprobe=1)
    assert_same_topk(top.keys, top.scores, want_ids, want_scores)
    assert floors and all(bool(torch.isfinite(f).all()) for f in floors)
