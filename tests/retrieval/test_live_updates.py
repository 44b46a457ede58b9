"""Live updates of a whole model (retrieval/live_updates.py): items from vectors or from the item
tower, attribute flips, removals, embedding rows (float and tiered tables); every refusal
names its field and leaves the model as it was."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from retrieval.data import SyntheticConfig, generate
from retrieval.index.live_index import positions, served, signatures_of
from retrieval.live_updates import (
    RemoveItems,
    SetItemAttributes,
    UpdateEmbeddings,
    UpdateError,
    UpsertItems,
    apply_update,
    prepare_update,
)
from retrieval.model import RetrievalModel
from retrieval.tiering import tier_model
from retrieval.training.prepare import Prepared, prepare
from sharded_tables.planner import Budgets
from sharded_tables.quantize import quantization_bound
from sharded_tables.specs import DType, Tier

USERS = np.arange(8)


@pytest.fixture(scope="module")
def setup() -> tuple[Prepared, RetrievalModel]:
    ds = generate(SyntheticConfig(num_users=50, num_items=300, seed=4))
    prep = prepare(ds, history_len=8)
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, ds.item_attributes)
    return prep, model.eval()


def forward(model: RetrievalModel, prep: Prepared, k: int = 10, filters=None) -> torch.Tensor:
    with torch.inference_mode():
        return model(prep.user_batch(USERS, filters), k)[0]


def attributes_of(prep: Prepared, item: int) -> dict[str, tuple[str, ...]]:
    cfg = prep.config
    return {
        name: (cfg.item_attributes[name][int(codes[item])],)
        for name, codes in prep.dataset.item_attributes.items()
    }


def query(model: RetrievalModel, prep: Prepared) -> torch.Tensor:
    with torch.inference_mode():
        return model.user_vectors(prep.user_batch(USERS[:1]))[0]


def test_new_item_with_a_vector_ranks_first_and_the_old_model_is_untouched(setup):
    prep, model = setup
    before = forward(model, prep)
    attrs = attributes_of(prep, 0)
    new_vec = query(model, prep)[None] * 50  # aligned with user 0's query, and long
    updated = apply_update(model, UpsertItems(torch.tensor([5000]), [attrs], new_vec))
    assert updated is not model and updated.index is not model.index
    assert updated.tables is model.tables and updated.user_tower is model.user_tower
    assert served(updated.index) == served(model.index) + 1
    assert forward(updated, prep)[0, 0].item() == 5000
    assert torch.equal(forward(model, prep), before)  # copy-on-write


def test_item_tower_vectors_match_the_build_and_attributes_feed_the_tower(setup):
    prep, model = setup
    items = torch.tensor([3, 11])
    attrs = [attributes_of(prep, 3), attributes_of(prep, 11)]
    smaller = apply_update(model, RemoveItems(items))
    assert (positions(smaller.index, items) < 0).all()
    again = apply_update(smaller, UpsertItems(items, attrs))
    pos_old, pos_new = positions(model.index, items), positions(again.index, items)
    torch.testing.assert_close(
        again.index.vectors_at(pos_new), model.index.vectors_at(pos_old), atol=1e-3, rtol=0
    )
    assert torch.equal(signatures_of(again.index, items), signatures_of(model.index, items))
    # other attribute values -> another tower input -> another vector
    other = dict(attrs[0], language=("ja",), category=("gaming",))
    moved = apply_update(model, UpsertItems(items[:1], [other]))
    feats = {f: t[3:4].clone() for f, t in prep.train.item_features.items()}
    feats["item_language"][:] = prep.config.item_attributes["language"].index("ja")
    feats["item_category"][:] = prep.config.item_attributes["category"].index("gaming")
    with torch.no_grad():
        want = model.item_vectors(feats)[0]
    got = moved.index.vectors_at(positions(moved.index, items[:1]))[0]
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    assert not torch.allclose(got, model.index.vectors_at(pos_old[:1])[0], atol=1e-3)


def test_attribute_flip_changes_eligibility_only(setup):
    prep, model = setup
    top = int(forward(model, prep, filters=["available"] * len(USERS))[0, 0])
    flipped = apply_update(
        model, SetItemAttributes(torch.tensor([top]), [{"available": ("false",)}])
    )
    assert top not in forward(flipped, prep, filters=["available"] * len(USERS))[0].tolist()
    pos_old = positions(model.index, torch.tensor([top]))
    pos_new = positions(flipped.index, torch.tensor([top]))
    schema = model.index.schema
    lang = [schema.bit_of[("language", v)] for v in schema.attribute_values["language"]]
    bits = lambda sig: [(int(sig[0, b // 64]) >> (b % 64)) & 1 for b in lang]  # noqa: E731
    assert bits(signatures_of(flipped.index, torch.tensor([top]))) == bits(
        signatures_of(model.index, torch.tensor([top]))
    )
    off = schema.bit_of[("available", "false")]
    assert (
        int(signatures_of(flipped.index, torch.tensor([top]))[0, off // 64]) >> (off % 64)
    ) & 1 == 1
    assert torch.equal(
        flipped.index.vectors_at(pos_new), model.index.vectors_at(pos_old)
    )  # vectors are not recomputed


def test_removed_items_are_never_recommended(setup):
    prep, model = setup
    top = forward(model, prep)[:, 0].unique()
    gone = apply_update(model, RemoveItems(top))
    assert not set(top.tolist()) & set(forward(gone, prep).flatten().tolist())
    assert served(gone.index) == served(model.index) - top.numel()


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            lambda p: UpsertItems(torch.tensor([7, 9000]), [{}, {}]),
            r"vectors\[1\]: item 9000 is beyond the item table \(rows 0\.\.299\)",
        ),
        (
            lambda p: UpsertItems(torch.tensor([7, 8]), [{}, {"language": ("xx",)}]),
            r"attributes\[1\]\.language: unknown value 'xx' \(known: en, ",
        ),
        (
            lambda p: UpsertItems(torch.tensor([7]), [{"colour": ("red",)}]),
            r"attributes\[0\]: unknown attribute 'colour'",
        ),
        (
            lambda p: UpsertItems(torch.tensor([7]), [{}], torch.zeros(1, 3)),
            r"vectors: expected float \[1, 64\]",
        ),
        (
            lambda p: UpsertItems(torch.tensor([7, 7]), [{}, {}]),
            r"ids\[1\]: 7 appears more than once",
        ),
        (
            lambda p: RemoveItems(torch.tensor([1, 4242])),
            r"ids\[1\]: item 4242 is not in the index",
        ),
        (lambda p: RemoveItems(torch.arange(300)), "ids: removing every item"),
        (
            lambda p: SetItemAttributes(torch.tensor([-1]), [{}]),
            r"ids\[0\]: must be >= 0, got -1",
        ),
        (
            lambda p: UpdateEmbeddings("nope", torch.tensor([1]), torch.zeros(1, 32)),
            "table: unknown table 'nope' \\(known: item, ",
        ),
        (
            lambda p: UpdateEmbeddings("item", torch.tensor([1, 300]), torch.zeros(2, 32)),
            r"rows\[1\]: 300 is not in \[0, 300\)",
        ),
        (
            lambda p: UpdateEmbeddings("item", torch.tensor([1]), torch.zeros(1, 31)),
            r"values: expected float \[1, 32\]",
        ),
        (
            lambda p: UpdateEmbeddings("item", torch.tensor([1]), torch.full((1, 32), np.inf)),
            r"values\[0\]: contains NaN or infinity",
        ),
    ],
)
def test_refusals_name_the_field_and_change_nothing(setup, batch, message):
    prep, model = setup
    index, weight = model.index, model.tables.bags()["item"].weight.clone()
    with pytest.raises(UpdateError, match=message):
        prepare_update(model, batch(prep))
    assert model.index is index and served(index) == 300
    assert torch.equal(model.tables.bags()["item"].weight, weight)


def test_float_table_rows_are_written_and_change_the_query(setup):
    prep, base = setup
    model = copy.deepcopy(base)
    hist = int(prep.user_batch(USERS[:1]).history[0, 0])
    before = query(model, prep)
    rows = torch.randn(1, 32)
    prepared = prepare_update(model, UpdateEmbeddings("item", torch.tensor([hist]), rows))
    assert torch.equal(query(model, prep), before)  # nothing until commit
    updated = prepared.commit()
    assert torch.equal(updated.tables.bags()["item"].weight[hist], rows[0])
    assert not torch.allclose(query(updated, prep), before)


def test_tiered_local_rows_are_repacked_in_the_table_dtype(setup):
    _, base = setup
    tiered, _ = tier_model(base, Budgets(device=0, host=1 << 30), dtype=DType.INT8)
    rows = torch.tensor([2, 40, 299])
    values = torch.randn(3, 32)
    apply_update(tiered, UpdateEmbeddings("item", rows, values))
    got = tiered.tables.local_float("item")[rows]
    bound = quantization_bound(values, DType.INT8)
    assert ((got - values).abs().amax(dim=1) <= bound + 1e-6).all()
    untouched = tiered.tables.local_float("item")[1]
    ref, _ = tier_model(base, Budgets(device=0, host=1 << 30), dtype=DType.INT8)
    assert torch.equal(untouched, ref.tables.local_float("item")[1])
    # the lookup path reads the new rows
    with torch.no_grad():
        pooled = tiered.tables({"history": rows[:1].view(1, 1)})["history"]
    torch.testing.assert_close(pooled[0], got[0])


def test_remote_tables_are_refused(setup):
    _, base = setup
    budgets = Budgets(device=0, host=16 << 10, remote_per_server=64 << 20, remote_servers=1)
    tiered, _ = tier_model(base, budgets, dtype=DType.FP32)
    assert tiered.tables.plan.placement("item").tier is Tier.REMOTE
    with pytest.raises(UpdateError, match="table: table 'item' lives on the remote tier"):
        prepare_update(tiered, UpdateEmbeddings("item", torch.tensor([1]), torch.zeros(1, 32)))


def test_a_live_model_saves_what_it_serves(setup, tmp_path):
    """The fresh segment is no buffer: saving folds it into the main lists first."""
    from retrieval.artifact import load_model, save_model

    prep, model = setup
    new_vec = query(model, prep)[None] * 50
    updated = apply_update(
        model, UpsertItems(torch.tensor([5000]), [attributes_of(prep, 0)], new_vec)
    )
    updated = apply_update(updated, RemoveItems(torch.tensor([7])))
    loaded = load_model(save_model(updated, tmp_path / "m"))
    assert loaded.index.live is None and served(loaded.index) == served(updated.index)
    assert forward(loaded, prep)[0, 0].item() == 5000
    assert 7 not in loaded.index.item_ids.tolist() and updated.index.live is not None
