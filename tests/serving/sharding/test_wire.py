"""The shard wire format (serving/sharding/wire.py): a plan's second-round lists travel."""

from __future__ import annotations

import pytest
import torch

from retrieval.filters import FilterBatch
from retrieval.index.search import SearchPlan
from serving.sharding.wire import decode_request, encode_request


def request(lists: torch.Tensor | None):
    q = torch.randn(2, 4)
    fb = FilterBatch(torch.ones(2, 1, 1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.bool))
    plan = SearchPlan(3, 5, torch.tensor([2, 7]), torch.tensor([False, True]), lists)
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
