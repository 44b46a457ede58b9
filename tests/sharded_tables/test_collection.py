"""EmbeddingCollection: pooled lookups over padded id matrices, shared tables, validation."""

from __future__ import annotations

import pytest
import torch

from sharded_tables import EmbeddingCollection, TableConfig


@pytest.fixture
def tables() -> EmbeddingCollection:
    return EmbeddingCollection(
        [
            TableConfig("item", 10, 4, features=("history", "item_id")),
            TableConfig("country", 5, 4, pooling="sum"),
        ]
    )


def test_mean_pooling_skips_padding_and_empty_bags_are_zero(tables):
    w = tables.tables["item"].weight
    out = tables({"history": torch.tensor([[3, 7, -1], [-1, -1, -1]])})
    torch.testing.assert_close(out["history"][0], (w[3] + w[7]) / 2)
    assert torch.all(out["history"][1] == 0)


def test_shared_table_and_sum_pooling(tables):
    out = tables({"item_id": torch.tensor([[5]]), "country": torch.tensor([[1, 1]])})
    torch.testing.assert_close(out["item_id"][0], tables.tables["item"].weight[5])
    torch.testing.assert_close(out["country"][0], 2 * tables.tables["country"].weight[1])


@pytest.mark.parametrize(
    "features,match",
    [
        ({"nope": torch.zeros(1, 1, dtype=torch.int64)}, "unknown feature"),
        ({"history": torch.zeros(1, 1)}, "int64"),
        ({"history": torch.tensor([[10]])}, r"id 10 is out of range for table 'item' \(rows 0..9"),
        ({"history": torch.tensor([[-2]])}, "padding"),
    ],
)
def test_validate_names_the_problem(tables, features, match):
    with pytest.raises(ValueError, match=match):
        tables.validate(features)


def test_gradients_reach_the_rows_used(tables):
    out = tables({"history": torch.tensor([[1, 2]])})
    out["history"].sum().backward()
    grad = tables.tables["item"].weight.grad
    assert grad is not None and grad[1].abs().sum() > 0 and grad[0].abs().sum() == 0
