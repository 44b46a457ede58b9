"""The fused inference lookup (``pooled_lookup``) equals the collection's training path
(``nn.EmbeddingBag`` with per-sample weights) bit for bit; the collection uses it only without
gradients (that gradients still reach the rows: ``test_collection.py``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharded_tables import EmbeddingCollection, TableConfig
from sharded_tables.pooled_lookup import pooled_lookup


def _collection(rows: int, dim: int, seed: int = 0) -> EmbeddingCollection:
    torch.manual_seed(seed)
    return EmbeddingCollection(
        [
            TableConfig("item", rows, dim, features=("history", "item_id")),
            TableConfig("country", 7, dim, pooling="sum"),
        ]
    )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    b=st.integers(1, 40),
    hist_len=st.integers(1, 30),
    dim=st.sampled_from([1, 3, 16, 64]),
    pad_share=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_fused_path_equals_the_training_path_exactly(b, hist_len, dim, pad_share, seed):
    tables = _collection(50, dim, seed)
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 50, (b, hist_len), generator=g)
    history[torch.rand(b, hist_len, generator=g) < pad_share] = -1  # some rows all padding
    features = {
        "history": history,
        "item_id": torch.randint(-1, 50, (b, 1), generator=g),
        "country": torch.randint(-1, 7, (b, 2), generator=g),
    }
    trained = tables(features)  # gradients on: nn.EmbeddingBag
    with torch.inference_mode():
        fused = tables(features)
    for name in features:
        assert trained[name].requires_grad  # the nn.EmbeddingBag path ran
        assert torch.equal(fused[name], trained[name].detach()), name


def test_empty_rows_are_zero_and_mean_divides_by_present_ids():
    w = torch.arange(12, dtype=torch.float32).view(4, 3)
    mean, total = pooled_lookup(
        [w, w], [torch.tensor([[1, 3, -1], [-1, -1, -1]]), torch.tensor([[2, 2]])], [True, False]
    )
    torch.testing.assert_close(mean[0], (w[1] + w[3]) / 2)
    assert torch.all(mean[1] == 0)
    torch.testing.assert_close(total[0], 2 * w[2])


@pytest.mark.parametrize("bad", [4, -2])
def test_an_id_out_of_range_is_refused(bad):
    with pytest.raises(RuntimeError, match=f"id {bad} is out of range for a table of 4 rows"):
        pooled_lookup([torch.zeros(4, 2)], [torch.tensor([[0, bad]])], [True])


def test_non_contiguous_ids_and_large_batches_use_every_row():
    w = torch.randn(100, 8)
    ids = torch.randint(0, 100, (3, 1000)).T  # [1000, 3], not contiguous
    (out,) = pooled_lookup([w], [ids], [False])
    torch.testing.assert_close(out, w[ids].sum(dim=1))


def test_the_fused_op_traces_under_torch_compile():
    tables = _collection(20, 4)
    features = {"history": torch.tensor([[1, 2, -1], [3, -1, -1]])}
    with torch.inference_mode():
        eager = tables(features)["history"]
    compiled = torch.compile(lambda f: tables(f)["history"], backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(features), eager)
