"""``recserve train --config train.toml``: data -> model -> training -> evaluation -> model folder.

The file's tables and keys, with an example: ``retrieval/training/config.py`` (:class:`RunConfig`).
Under torchrun every rank trains its part (``retrieval/training/distributed.py``); rank 0
evaluates and writes the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrieval.data import RecDataset, generate, load_movielens
from retrieval.index.exact import recall_at_k
from retrieval.metrics import popularity_recs, ranking_metrics
from retrieval.model import RetrievalModel
from retrieval.training.config import DataConfig, EvaluateConfig, ModelSection, RunConfig
from retrieval.training.distributed import DistContext
from retrieval.training.prepare import Prepared, prepare
from retrieval.training.train import Trainer

__all__ = ["RunConfig", "RunResult", "evaluator", "load_data", "prepare_run", "run_training"]


def load_data(data: DataConfig) -> RecDataset:
    """``[data]`` -> a dataset."""
    if data.source == "movielens":
        return load_movielens(data.data_dir)
    return generate(data.synthetic())


def prepare_run(ds: RecDataset, model: ModelSection) -> Prepared:
    """The dataset and ``[model]`` -> prepared inputs and a validated model config; a
    ``user_features`` name the data lacks is refused naming the field."""
    prep = prepare(
        ds,
        history_len=model.history_len,
        index=model.index.build(ds.num_items),
        **model.overrides(),
    )
    wanted = model.user_features
    if wanted is not None:
        missing = [f for f in wanted if f not in prep.config.user_features]
        if missing:
            raise ValueError(
                f"model.user_features: {missing} are not features of the data "
                f"(it has {sorted(prep.config.user_features)})"
            )
        prep.config.user_features = {f: prep.config.user_features[f] for f in wanted}
        cols = [list(ds.user_feature_sizes).index(f) for f in wanted]
        prep.train.categorical = prep.train.categorical[:, cols]
    prep.config.validate()
    return prep


def evaluator(prep: Prepared, cfg: EvaluateConfig) -> Any:
    """``model -> metrics``: builds the index, then recall@K / NDCG@K on held-out interactions
    (popularity baseline alongside) and the index's recall against exact search."""
    k = cfg.k
    users = np.array([u for u in range(prep.dataset.num_users) if prep.test_items[u]])
    if cfg.users:
        users = users[: cfg.users]
    relevant = [prep.test_items[u] for u in users]
    pop = ranking_metrics(
        popularity_recs(prep.train.item_ids, prep.dataset.num_items, prep.history[users], k),
        relevant,
        k,
    )

    def evaluate(model: RetrievalModel) -> dict[str, float]:
        model.build_index(prep.train.item_features, prep.dataset.item_attributes, prep.tune_batch())
        with torch.no_grad():  # not inference_mode: fbgemm's training op needs autograd keys
            batch = prep.user_batch(users)
            approx = model(batch, k)[0]
            exact = model(batch, k, exact=True)[0]
        ours = ranking_metrics(approx.numpy(), relevant, k)
        return {
            f"recall@{k}": ours[f"recall@{k}"],
            f"ndcg@{k}": ours[f"ndcg@{k}"],
            f"popularity_recall@{k}": pop[f"recall@{k}"],
            f"index_recall@{k}": recall_at_k(approx, exact),
        }

    return evaluate


@dataclass
class RunResult:
    model: RetrievalModel
    prep: Prepared
    epoch_losses: list[float]
    evals: list[dict[str, float]]


def run_training(
    cfg: RunConfig, dist_ctx: DistContext | None = None, resume: Path | None = None
) -> RunResult:
    """Trains as configured; the model comes back with its index built (on rank 0)."""
    seed = cfg.train.seed
    ds = load_data(cfg.data)
    prep = prepare_run(ds, cfg.model)
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = RetrievalModel(prep.config)
    main = dist_ctx is None or dist_ctx.is_main
    evaluate = evaluator(prep, cfg.evaluate) if main else None
    trainer = Trainer(
        model, prep.train, cfg.train, evaluate if dist_ctx is None else None, dist_ctx
    )
    if resume is not None:
        trainer.resume(resume)
    trainer.fit()
    evals = trainer.evals
    if dist_ctx is not None and evaluate is not None:  # ranks evaluate nothing mid-run
        evals = [{"epoch": float(cfg.train.epochs), **evaluate(model)}]
    elif evaluate is not None and not evals:
        evals = [evaluate(model)]
    if main and model.index.ntotal == 0:
        model.build_index(prep.train.item_features, ds.item_attributes, prep.tune_batch())
    return RunResult(model, prep, trainer.epoch_losses, evals)
