"""RetrievalModel end to end on synthetic data: forward, filters, compile, save/load, bad input."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

from retrieval.artifact import load_model, load_state, save_model
from retrieval.config import ModelConfig
from retrieval.data import SyntheticConfig, generate
from retrieval.features import make_user_batch
from retrieval.filters import eligible
from retrieval.format import read_config
from retrieval.index.ivf import IVFConfig
from retrieval.metrics import popularity_recs, ranking_metrics
from retrieval.model import RetrievalModel
from retrieval.training.prepare import prepare
from retrieval.training.train import TrainConfig, train
from support.formats import unversioned
from support.topk_check import assert_same_topk


@pytest.fixture(scope="module")
def trained(trained_synthetic):
    """The default index settings (``tests/retrieval/conftest.py``): shared with the tiering
    tests, trained once."""
    return trained_synthetic


@pytest.mark.slow  # the trained fixture
def test_training_lowers_the_loss_and_beats_popularity(trained):
    prep, model, losses = trained
    assert losses[-1] < losses[0]
    users = np.array([u for u in range(prep.dataset.num_users) if prep.test_items[u]])
    with torch.inference_mode():
        recs = model(prep.user_batch(users), 100)[0].numpy()
    pop = popularity_recs(prep.train.item_ids, prep.dataset.num_items, prep.history[users], 100)
    rel = [prep.test_items[u] for u in users]
    assert (
        ranking_metrics(recs, rel, 100)["recall@100"]
        > 1.2 * ranking_metrics(pop, rel, 100)["recall@100"]
    )


@pytest.mark.slow  # the trained fixture
def test_forward_excludes_history_and_respects_filters(trained):
    prep, model, _ = trained
    users = np.arange(32)
    text = "language in {en, fr} and available and not age_rating = '18+'"
    with torch.inference_mode():
        ids, scores = model(prep.user_batch(users, [text] * 32), 50)
    assert ids.shape == (32, 50) and scores.shape == (32, 50)
    hist = prep.history[users]
    assert not any(set(r) & set(h[h >= 0]) for r, h in zip(ids.tolist(), hist, strict=True))
    fb = model.index.compile_filter(text, 1)
    ok = torch.zeros(model.index.ntotal, dtype=torch.bool)
    ok[model.index.item_ids[eligible(model.index.sig, fb.masks[0], fb.negate[0])]] = True
    assert ok[ids[ids >= 0]].all()
    assert torch.all(scores[:, :-1] >= scores[:, 1:])


@pytest.mark.slow  # the trained fixture
@pytest.mark.parametrize("b", [1, 5, 40])
def test_forward_without_a_head_answers_what_the_positions_give(trained, b):
    """The forward keyed by item id (one C++ call for a few plain rows; the positions mapped
    otherwise: 40 rows, more than FEW_QUERIES) answers what the index's positions, mapped to
    ids and ranked, give: the path a scoring head takes."""
    prep, model, _ = trained
    assert model.head is None
    batch = prep.user_batch(np.arange(b) * 7)
    with torch.inference_mode():
        ids, scores = model(batch, 30)
        q = model.user_vectors(batch)
        r, fb = model.candidate_budget(batch, 30)
        cfg = model.index.config
        pos, dot = model.index.search(
            q, r, fb, nprobe=cfg.nprobe, rerank=cfg.rerank, positions=True
        )
        want = model.rank(
            q, torch.where(pos >= 0, model.index.item_ids[pos.clamp(min=0)], pos), dot, None, 30
        )
    assert torch.equal(ids, want[0]) and torch.equal(scores, want[1])


@pytest.mark.slow  # the trained fixture
def test_index_recall_against_exact_search(trained):
    prep, model, _ = trained
    batch = prep.user_batch(np.arange(200))
    with torch.inference_mode():
        approx, _ = model(batch, 100)
        exact, _ = model(batch, 100, exact=True)
    hits = sum(len(set(a) & set(e)) for a, e in zip(approx.tolist(), exact.tolist(), strict=True))
    assert hits / exact.numel() >= 0.95


@pytest.mark.slow
@pytest.mark.multiproc  # inductor compile workers
def test_torch_compile_equals_eager(trained):
    prep, model, _ = trained
    batch = prep.user_batch(np.arange(16), [None] * 8 + ["region in {eu, na}"] * 8)
    with torch.inference_mode():
        eager = model(batch, 100)
        compiled = torch.compile(model)(batch, 100)
    # inductor fuses the towers' ops, so q may differ in the last float bits: ids may swap
    # only where two scores tie that closely
    assert_same_topk(eager[0], eager[1], compiled[0], compiled[1], atol=1e-5)


@pytest.mark.slow  # the trained fixture
def test_state_dict_round_trip_weights_only(trained, tmp_path):
    prep, model, _ = trained
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = RetrievalModel(prep.config)
    load_state(fresh, torch.load(buf, weights_only=True))
    batch = prep.user_batch(np.arange(64), ["available"] * 64)
    with torch.inference_mode():
        assert torch.equal(model(batch, 100)[0], fresh(batch, 100)[0])
    again = load_model(save_model(model, tmp_path / "m"))
    with torch.inference_mode():
        assert torch.equal(model(batch, 100)[0], again(batch, 100)[0])


@pytest.mark.slow  # the trained fixture
def test_a_version_saved_before_an_index_buffer_loads_and_answers_as_it_did(trained):
    """A version published before the index kept its lists' sizes as built (``built_sizes``)
    loads (the index probes every planned list then), as one saved before the bound check's
    statistics does."""
    prep, model, _ = trained
    for name in ("built_sizes", "list_radius"):
        saved = unversioned(model.state_dict(), "index.")
        state = {k: v for k, v in saved.items() if k != f"index.{name}"}
        old = RetrievalModel(prep.config)
        load_state(old, state)
        assert getattr(old.index, name).numel() == 0
        then = copy.deepcopy(model)
        setattr(then.index, name, getattr(then.index, name)[:0])
        batch = prep.user_batch(np.arange(16), [None] * 8 + ["available"] * 8)
        with torch.inference_mode():
            assert torch.equal(old(batch, 100)[0], then(batch, 100)[0])


@pytest.mark.slow  # the trained fixture
def test_loading_another_config_says_which_tensor(trained):
    prep, model, _ = trained
    other = copy.deepcopy(prep.config)
    other.out_dim = 32
    with pytest.raises(ValueError, match=r"user_tower\.mlp\.2\.weight"):
        load_state(RetrievalModel(other), model.state_dict())


@pytest.mark.slow  # the trained fixture
def test_k_larger_than_history_and_10000(trained):
    prep, model, _ = trained
    with torch.inference_mode():
        ids, _ = model(prep.user_batch(np.arange(2)), 2900)
    for row, h in zip(ids.tolist(), prep.history[:2], strict=True):
        valid = [x for x in row if x >= 0]
        assert (
            len(valid) == len(set(valid)) == min(2900, prep.dataset.num_items - int((h >= 0).sum()))
        )


def _bad(batch, **changes):
    b = copy.copy(batch)
    for k, v in changes.items():
        setattr(b, k, v)
    return b


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda b: _bad(b, history=b.history.float()), "history"),
        (lambda b: _bad(b, categorical=b.categorical[:, :1]), "categorical"),
        (lambda b: _bad(b, dense=b.dense.double()), "dense"),
        (lambda b: _bad(b, dense=b.dense * float("nan")), "dense"),
        (lambda b: _bad(b, history=b.history + 10**6), "history"),
        (lambda b: _bad(b, filter_masks=b.filter_masks[:, :, :0]), "filter_masks"),
    ],
)
@pytest.mark.slow  # the trained fixture
def test_bad_batches_raise_value_error_naming_the_field(trained, change, match):
    prep, model, _ = trained
    batch = prep.user_batch(np.arange(4), ["available"] * 4)
    with pytest.raises(ValueError, match=match):
        model(change(batch), 10)


@pytest.mark.parametrize("k", [0, -3, 10**7])
@pytest.mark.slow  # the trained fixture
def test_bad_k(trained, k):
    prep, model, _ = trained
    with pytest.raises(ValueError, match="k"):
        model(prep.user_batch(np.arange(2)), k)


@pytest.mark.slow  # the trained fixture
def test_unknown_filter_attribute(trained):
    prep, _, _ = trained
    with pytest.raises(ValueError, match="colour"):
        prep.user_batch(np.arange(2), ["colour = red"] * 2)


@pytest.mark.slow
@pytest.mark.multiproc  # inductor compile workers
def test_scoring_head_trains_and_serves():
    ds = generate(SyntheticConfig(num_users=300, num_items=800, seed=5))
    prep = prepare(
        ds,
        history_len=10,
        scoring_head=True,
        head_tasks=("click", "watch"),
        head_task_weights=(1.0, 0.5),
        index=IVFConfig(nlist=16, nprobe=4),
    )
    assert isinstance(prep.config, ModelConfig)
    model = RetrievalModel(prep.config)
    train(model, prep.train, TrainConfig(epochs=1, batch_size=128, progress=False))
    assert model.head is not None and model.head.mlp[-1].weight.abs().sum() > 0  # it learned
    model.build_index(prep.train.item_features, ds.item_attributes)
    batch = prep.user_batch(np.arange(8))
    with torch.inference_mode():
        ids, _scores = model(batch, 20)
        compiled = torch.compile(model)(batch, 20)
    assert (ids >= 0).all() and torch.equal(ids, compiled[0])


def test_recent_window_is_pooled_apart_and_old_configs_load_without_it() -> None:
    cfg = ModelConfig(num_items=20, user_features={}, dense_dim=0, item_attributes={}, recent_len=3)
    model = RetrievalModel(cfg)
    assert model.tables.table_of["recent"] == "item"
    assert model.user_tower.mlp[0].in_features == 2 * cfg.embedding_dim
    old = cfg.to_dict()
    del old["recent_len"]  # a config.json written before the field existed
    assert read_config(old).recent_len == 0  # through the format's migration
    with pytest.raises(ValueError, match="recent_len"):
        ModelConfig(num_items=20, user_features={}, dense_dim=0, item_attributes={}, recent_len=-1)


def test_attention_tower_reads_the_sequence_in_order() -> None:
    cfg = ModelConfig(
        num_items=30, user_features={"region": 3}, dense_dim=1, item_attributes={},
        history_len=6, attention_len=4, out_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = RetrievalModel(cfg)
    assert model.tables.table_of["history_seq"] == "item"
    hist = torch.tensor([[3, 4, 5, -1, -1, -1], [-1] * 6, [7, 8, 9, 10, 11, 12]])
    batch = make_user_batch(
        hist, torch.tensor([[0], [1], [2]]), torch.zeros(3, 1), model.index.schema
    )
    q = model.user_vectors(batch)
    assert q.shape == (3, 8) and torch.isfinite(q).all()  # a user with no history too
    # the order of the attended items matters (positions), not only the set
    swapped = make_user_batch(
        hist[[0]][:, [1, 0, 2, 3, 4, 5]], torch.tensor([[0]]), torch.zeros(1, 1), model.index.schema
    )
    assert not torch.allclose(model.user_vectors(swapped), q[:1])
    # items beyond attention_len are not attended: only the pooled window sees them
    assert model.lookup(model.user_sparse(batch))["history_seq"].shape == (3 * 4, cfg.embedding_dim)


@pytest.mark.slow
@pytest.mark.multiproc  # inductor compile workers
def test_attention_tower_compiles() -> None:
    cfg = ModelConfig(
        num_items=30, user_features={}, dense_dim=0, item_attributes={},
        history_len=6, attention_len=4, out_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = RetrievalModel(cfg)
    hist = torch.tensor([[3, 4, 5, -1, -1, -1], [-1] * 6])
    batch = make_user_batch(hist, torch.zeros(2, 0), torch.zeros(2, 0), model.index.schema)
    torch._dynamo.reset()  # traced afresh, not specialised by earlier tests' compiles
    with torch.inference_mode():
        eager = model.user_vectors(batch)
        compiled = torch.compile(model.user_vectors)(batch)
    assert torch.allclose(compiled, eager, atol=1e-5)
