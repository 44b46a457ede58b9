"""TrainableTables: fbgemm training TBE with a fused optimizer, against EmbeddingCollection."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from sharded_tables import EmbeddingCollection, TableConfig
from sharded_tables.trainable import TrainableTables

CONFIGS = [
    TableConfig("item", 10, 4, features=("history", "item_id")),
    TableConfig("country", 5, 8, pooling="sum"),
    TableConfig("tag", 7, 4, features=("item_tag",)),
]
ROWS = {"history": 10, "item_id": 10, "country": 5, "item_tag": 7}


def make(optimizer: str = "sgd", lr: float = 0.1, seed: int = 0) -> TrainableTables:
    return TrainableTables(CONFIGS, optimizer=optimizer, learning_rate=lr, seed=seed)


def twin(tables: TrainableTables) -> EmbeddingCollection:
    """An EmbeddingCollection holding copies of ``tables``' rows."""
    ec = EmbeddingCollection(CONFIGS)
    with torch.no_grad():
        for name, w in tables.weights().items():
            ec.bags()[name].weight.copy_(w)
    return ec


def batch(seed: int, b: int = 6) -> dict[str, torch.Tensor]:
    """Random padded ids with repeats, empty bags and every feature (seeded)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for f, rows in ROWS.items():
        ids = torch.randint(0, rows, (b, 5), generator=g)
        out[f] = ids.masked_fill(torch.rand(b, 5, generator=g) < 0.3, -1)
    out["history"][0] = -1  # one empty mean bag
    return out


def mse(out: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return sum(  # type: ignore[return-value]
        F.mse_loss(x, torch.randn(x.shape, generator=g), reduction="sum")
        for _, x in sorted(out.items())
    )


# ---- forward ---------------------------------------------------------------------------------
def test_mean_skips_padding_sum_pools_and_shared_table():
    tables = make()
    w = tables.weights()
    out = tables(
        {
            "history": torch.tensor([[3, 7, -1], [-1, -1, -1]]),
            "item_id": torch.tensor([[5], [5]]),
            "country": torch.tensor([[1, 1], [2, -1]]),
        }
    )
    torch.testing.assert_close(out["history"][0], (w["item"][3] + w["item"][7]) / 2)
    assert torch.all(out["history"][1] == 0)
    torch.testing.assert_close(out["item_id"][1], w["item"][5])
    torch.testing.assert_close(out["country"][0], 2 * w["country"][1])
    assert set(out) == {"history", "item_id", "country"}


_SHARED = make()
_SHARED_TWIN = twin(_SHARED)


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 5),
    widths=st.fixed_dictionaries({f: st.integers(1, 6) for f in ROWS}),
    chosen=st.sets(st.sampled_from(sorted(ROWS)), min_size=1),
    seed=st.integers(0, 2**31 - 1),
)
def test_forward_equals_embedding_collection(b, widths, chosen, seed):
    g = torch.Generator().manual_seed(seed)
    features = {f: torch.randint(-1, ROWS[f], (b, widths[f]), generator=g) for f in sorted(chosen)}
    _SHARED.validate(features)
    got, want = _SHARED(features), _SHARED_TWIN(features)
    assert set(got) == set(want)
    for f in features:
        torch.testing.assert_close(got[f], want[f], atol=1e-6, rtol=1e-6)


def test_zero_width_features_pool_to_zeros():
    out = _SHARED(
        {"history": torch.zeros(3, 0, dtype=torch.int64), "country": torch.tensor([[1]] * 3)}
    )
    assert out["history"].shape == (3, 4) and torch.all(out["history"] == 0)


def test_seeded_init_is_reproducible_and_scaled():
    a, b, c = make(seed=3), make(seed=3), make(seed=4)
    for name in a.weights():
        assert torch.equal(a.weights()[name], b.weights()[name])
        assert not torch.equal(a.weights()[name], c.weights()[name])
    big = TrainableTables([TableConfig("t", 2000, 16)], init_std=0.05, seed=0)
    assert abs(big.weights()["t"].std().item() - 0.05) < 0.002


# ---- fused optimizer ----------------------------------------------------------------------------
def test_one_sgd_step_equals_manual_update():
    lr = 0.5
    tables = make("sgd", lr=lr)
    ec = twin(tables)
    before = {n: w.clone() for n, w in tables.weights().items()}
    features = batch(1)
    mse(ec(features), seed=2).backward()
    mse(tables(features), seed=2).backward()  # updates the rows here
    for name, bag in ec.bags().items():
        assert bag.weight.grad is not None
        expected = before[name] - lr * bag.weight.grad
        torch.testing.assert_close(tables.weights()[name], expected, atol=1e-6, rtol=0)
        assert not torch.equal(tables.weights()[name], before[name])


def test_rowwise_adagrad_step_matches_its_formula():
    lr, eps = 0.1, 1e-8
    tables = TrainableTables(CONFIGS, "rowwise_adagrad", learning_rate=lr, eps=eps, seed=0)
    ec = twin(tables)
    before = {n: w.clone() for n, w in tables.weights().items()}
    features = batch(5)
    mse(ec(features), seed=6).backward()
    mse(tables(features), seed=6).backward()
    for name, bag in ec.bags().items():
        g = bag.weight.grad
        assert g is not None
        acc = (g * g).mean(dim=1)  # [rows]
        torch.testing.assert_close(tables.optimizer_state()[name]["sum"], acc)
        expected = before[name] - lr * g / (acc.sqrt()[:, None] + eps)
        torch.testing.assert_close(tables.weights()[name], expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad"])
def test_short_training_loop_lowers_the_loss(optimizer):
    tables = make(optimizer, lr=0.1)
    features = batch(7, b=16)
    with torch.no_grad():  # reachable targets: another set of tables' outputs
        targets = TrainableTables(CONFIGS, init_std=0.5, seed=99)(features)
    losses = []
    for _ in range(40):
        out = tables(features)
        loss = sum(F.mse_loss(out[f], targets[f], reduction="sum") for f in out)
        loss.backward()  # type: ignore[union-attr]
        losses.append(loss.item())  # type: ignore[union-attr]
    assert losses[-1] < 0.1 * losses[0]


def test_no_parameters_so_a_torch_optimizer_only_moves_the_dense_part():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tables = make("sgd", lr=0.1)
            self.head = nn.Linear(4, 1)

        def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.head(self.tables(features)["history"])

    model = Model()
    assert [n for n, _ in model.named_parameters()] == ["head.weight", "head.bias"]
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rows, head = model.tables.weights()["item"].clone(), model.head.weight.detach().clone()
    loss = model({"history": torch.tensor([[1, 2, -1]])}).square().sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    moved = (model.tables.weights()["item"] != rows).any(dim=1)
    assert moved.tolist() == [i in (1, 2) for i in range(10)]
    assert not torch.equal(model.head.weight, head)


# ---- state ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad", "sgd"])
def test_state_round_trip_continues_identically(optimizer):
    a = make(optimizer, lr=0.05, seed=0)
    for step in range(3):
        mse(a(batch(step)), seed=step).backward()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    snapshot = {n: w.clone() for n, w in a.weights().items()}
    b = make(optimizer, lr=0.05, seed=1)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for model in (a, b):
        mse(model(batch(10)), seed=10).backward()
    for name in a.weights():
        assert torch.equal(a.weights()[name], b.weights()[name])
        assert not torch.equal(a.weights()[name], snapshot[name])
        for s, t in zip(
            a.optimizer_state()[name].values(), b.optimizer_state()[name].values(), strict=True
        ):
            assert torch.equal(s, t)
    if optimizer != "sgd":
        assert a.optimizer_state()["item"]["sum"].abs().sum() > 0


def test_state_dict_is_a_snapshot():
    tables = make("rowwise_adagrad")
    state = tables.state_dict()
    saved = state["_extra_state"]["weights"]["item"].clone()
    mse(tables(batch(0)), seed=0).backward()
    assert torch.equal(state["_extra_state"]["weights"]["item"], saved)


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "features,match",
    [
        ({"nope": torch.zeros(1, 1, dtype=torch.int64)}, "unknown feature 'nope'"),
        ({"history": torch.zeros(1, 1)}, "feature 'history': expected int64"),
        (
            {"history": torch.tensor([[3, 10]])},
            r"'history': id 10 is out of range for table 'item'",
        ),
        (
            {"country": torch.tensor([[-2]])},
            r"'country': id -2 is out of range for table 'country'",
        ),
        (
            {"history": torch.zeros(2, 1, dtype=torch.int64), "country": torch.zeros(3, 1).long()},
            "different batch sizes",
        ),
    ],
)
def test_validate_names_feature_table_and_id(features, match):
    with pytest.raises(ValueError, match=match):
        _SHARED.validate(features)


def test_bad_configs_and_loads_raise():
    with pytest.raises(ValueError, match=r"\['adagrad', 'rowwise_adagrad', 'sgd'\].*'adam'"):
        TrainableTables(CONFIGS, optimizer="adam")
    with pytest.raises(ValueError, match=r"table 'odd'.*multiple of 4"):
        TrainableTables([TableConfig("odd", 10, 6)])
    with pytest.raises(ValueError, match=r"table 'item'.*pooling"):
        TrainableTables([TableConfig("item", 10, 4, pooling="max")])
    tables = make()
    with pytest.raises(ValueError, match=r"table 'item'.*\[10, 4\]"):
        tables.load_weights({"item": torch.zeros(9, 4)})
    with pytest.raises(ValueError, match="unknown table 'x'"):
        tables.load_weights({"x": torch.zeros(9, 4)})
    with pytest.raises(ValueError, match="optimizer 'rowwise_adagrad'"):
        tables.load_state_dict(make("rowwise_adagrad").state_dict())
