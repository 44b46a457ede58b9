"""The admin messages' id bounds (``serving/live/messages.py``): a new call's item ids are below
the catalog + ``limits.max_item_id_growth`` (one bound for ``UpsertItems`` and ``AddSeen``), its
seen users below the store's users + ``limits.max_seen_user_growth``, refused naming the field
and the bound before anything is built; a log's records are parsed with no bound."""

from __future__ import annotations

import pytest
import torch

from retrieval.update_batches import AddSeen, UpsertItems
from serving.live.messages import CallBounds, from_record, parse_add_seen, parse_upsert
from serving.protos import admin_pb2 as pb
from serving.types import RequestError

BOUNDS = CallBounds(catalog=300, item_growth=10, store_users=100, user_growth=5)
PAST = "is past the catalog's 300 items + 10 (limits.max_item_id_growth): ids up to 309 are taken"
DIM = 4


def _upsert(*ids: int, width: int = DIM) -> pb.UpsertItemsRequest:
    return pb.UpsertItemsRequest(items=[pb.Item(id=i, vector=[0.5] * width) for i in ids])


def test_an_upsert_takes_ids_up_to_the_bound():
    batch = parse_upsert(_upsert(0, 299, 309), DIM, BOUNDS)
    assert batch.ids.tolist() == [0, 299, 309]


@pytest.mark.parametrize("huge", [310, 1 << 40, 1 << 62, 2**63 - 1])
def test_an_upsert_past_the_bound_names_the_items_id(huge):
    with pytest.raises(RequestError) as err:
        parse_upsert(_upsert(5, huge), DIM, BOUNDS)
    assert str(err.value) == f"items[1].id: item {huge} {PAST}"


def test_the_id_is_checked_before_the_vectors():
    """Item 1's vector is the wrong width too: the id, checked first, is what is refused (no
    vector is built for a call that names an item past the bound)."""
    with pytest.raises(RequestError, match=r"^items\[1\]\.id: item 1000 is past"):
        parse_upsert(_upsert(5, 1000, width=DIM + 1), DIM, BOUNDS)


def test_seen_pairs_share_the_item_bound_and_keep_the_user_bound():
    batch = parse_add_seen(pb.AddSeenRequest(users=[0, 104], items=[309, 0]), BOUNDS)
    assert (batch.users.tolist(), batch.items.tolist()) == ([0, 104], [309, 0])
    with pytest.raises(RequestError) as err:
        parse_add_seen(pb.AddSeenRequest(users=[1, 2], items=[3, 1 << 62]), BOUNDS)
    assert str(err.value) == f"items[1]: item {1 << 62} {PAST}"
    with pytest.raises(RequestError) as err:
        parse_add_seen(pb.AddSeenRequest(users=[1, 105], items=[3, 3]), BOUNDS)
    assert str(err.value) == (
        "users[1]: user 105 is past the seen store's 100 users + 5 "
        "(limits.max_seen_user_growth): ids up to 104 are taken"
    )


def test_without_a_store_only_the_items_are_bounded():
    """No seen store: the model refuses the call (naming ``users``), not the parser."""
    bounds = CallBounds(catalog=300, item_growth=0)
    assert parse_add_seen(pb.AddSeenRequest(users=[10**9], items=[299]), bounds).users.numel() == 1
    with pytest.raises(RequestError, match=r"^items\[0\]: item 300 is past the catalog's 300"):
        parse_add_seen(pb.AddSeenRequest(users=[1], items=[300]), bounds)


def test_negative_ids_are_left_to_the_model():
    """The bound refuses only ids at or past it; ``-1`` is the model's to refuse (``>= 0``)."""
    assert parse_upsert(_upsert(-1), DIM, BOUNDS).ids.tolist() == [-1]


def test_log_records_are_parsed_with_no_bound():
    """A record was taken once, maybe under looser bounds: replay parses it whatever its ids."""
    upsert = from_record(pb.LogRecord(sequence=1, upsert_items=_upsert(1 << 62)), DIM, {})
    assert isinstance(upsert, UpsertItems) and upsert.ids.tolist() == [1 << 62]
    seen = pb.AddSeenRequest(users=[1 << 40], items=[1 << 62])
    batch = from_record(pb.LogRecord(sequence=2, add_seen=seen), DIM, {})
    assert isinstance(batch, AddSeen) and torch.equal(batch.items, torch.tensor([1 << 62]))
