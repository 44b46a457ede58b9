"""`recserve train` on a small catalog (80 items, users with a single interaction): K larger
than the catalog is refused before any training, a failing test evaluation leaves the model
folder written, and the run reports who each split left out, the steps per epoch and the kept
epoch, with no faiss warning on stderr."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import recserve.train as train_module
from retrieval.artifact import load_model
from retrieval.training.train import Trainer

CONFIG = """
[data]
num_users = 200
num_items = 80
interactions_per_user = 5
min_interactions = 1
[model]
embedding_dim = 8
hidden = [16]
out_dim = 8
history_len = 8
[train]
epochs = 3
batch_size = {batch}
progress = false
[evaluate]
k = {k}
validation = 0.2
patience = 1
"""


def write(tmp: Path, k: int = 10, batch: int = 512) -> Path:
    path = tmp / "train.toml"
    path.write_text(CONFIG.format(k=k, batch=batch))
    return path


def test_k_larger_than_the_catalog_is_refused_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "fit", lambda self: pytest.fail("trained before the check"))
    with pytest.raises(ValueError, match=r"^evaluate\.k: 100 is larger than the catalog \(80"):
        train_module.run(write(tmp_path, k=100), tmp_path / "out", resume=False, ctx=None)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_failing_test_evaluation_leaves_the_model_folder(tmp_path, monkeypatch):
    def broken(result, cfg):
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(train_module, "evaluate_test", broken)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="evaluation broke"):
        train_module.run(write(tmp_path), out, resume=False, ctx=None)
    model = load_model(out / "model")
    assert model.index.ntotal == 80
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["test"] is None and metrics["kept_epoch"] >= 1


@pytest.mark.slow
def test_a_small_run_reports_what_it_left_out_and_builds_quietly(tmp_path, capfd, caplog):
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        result = train_module.run(write(tmp_path), out, resume=False, ctx=None)
    assert result is not None and result.prep.counts is not None
    printed = capfd.readouterr()
    assert "please provide at least" not in printed.err
    warned = [r.getMessage() for r in caplog.records if r.name == "retrieval.training.checks"]
    assert len(warned) == 1 and "train.batch_size = 512 against" in warned[0]
    assert "1 step per epoch" in warned[0]

    metrics = json.loads((out / "metrics.json").read_text())
    split = metrics["split"]
    assert split == {k: getattr(result.prep.counts, k) for k in split}
    assert split["users_kept_out_of_test"] > 0  # users with a single interaction
    assert (
        split["users_in_test"]
        + split["users_kept_out_of_test"]
        + split["users_without_interactions"]
        == 200
    )
    assert metrics["batch"]["steps"] == 1 and metrics["batch"]["batch_size"] == 512
    assert metrics["evaluated"]["test_users"] == split["users_in_test"]
    assert 1 <= metrics["kept_epoch"] <= len(metrics["evals"]) <= 3
    best = max(e["recall@10"] for e in metrics["evals"])
    assert metrics["evals"][metrics["kept_epoch"] - 1]["recall@10"] == best
    assert set(metrics["test"]) >= {"recall@10", "ndcg@10", "popularity_recall@10"}
    for text in ("kept out of test", "1 step per epoch", "kept the weights of epoch"):
        assert text in printed.out, text
