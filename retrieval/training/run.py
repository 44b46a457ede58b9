"""``recserve train --config train.toml``: data -> checks -> training (validation each epoch,
early stopping) -> the kept weights with their index; then the caller saves the model folder and
only then evaluates the test split (:func:`evaluate_test`), so a failing evaluation never loses
the trained model.

The file's tables and keys, with an example: ``retrieval/training/config.py`` (:class:`RunConfig`).
Under torchrun every rank trains its part (``retrieval/training/distributed.py``: TorchRec's
DistributedModelParallel over the tables); rank 0 evaluates and writes the result.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrieval.data import RecDataset, generate, load_movielens, read_parquet
from retrieval.data.raw_user_ids import FEATURE as RAW_ID
from retrieval.data.raw_user_ids import with_raw_user_ids
from retrieval.index.exact import recall_at_k
from retrieval.metrics import popularity_recs, ranking_metrics
from retrieval.model import RetrievalModel
from retrieval.seen_store import SeenStore
from retrieval.training.checks import EpochPlan, check_run
from retrieval.training.config import DataConfig, EvaluateConfig, ModelSection, RunConfig
from retrieval.training.distributed import DistContext
from retrieval.training.early_stopping import EarlyStopping
from retrieval.training.prepare import Prepared, prepare
from retrieval.training.train import Trainer

__all__ = [
    "RunConfig",
    "RunResult",
    "evaluate_test",
    "evaluator",
    "load_data",
    "prepare_run",
    "run_training",
]


def load_data(data: DataConfig) -> RecDataset:
    """``[data]`` -> a dataset (an imported one carries its raw ids: ``ds.ids``)."""
    if data.source == "movielens":
        return load_movielens(data.data_dir)
    if data.source == "parquet":
        assert data.path is not None  # the config requires it with source = "parquet"
        try:
            return read_parquet(data.path)
        except (OSError, ValueError) as e:
            raise ValueError(f"data.path: {e}") from None
    return generate(data.synthetic())


def prepare_run(ds: RecDataset, model: ModelSection, validation: float = 0.0) -> Prepared:
    """The dataset and ``[model]`` -> prepared inputs (``validation``: share of each user's
    training interactions held out) and a validated model config; a ``user_features`` name the
    data lacks is refused naming the field. ``[model] hashed_user_id`` adds the hashed feature
    ``raw_id`` (:mod:`retrieval.data.raw_user_ids`)."""
    hashed: tuple[str, ...] = ()
    if model.hashed_user_id:
        with_raw_user_ids(ds, model.hashed_user_id)
        hashed = (RAW_ID,)
    prep = prepare(ds, validation=validation, hashed_user_features=hashed, **model.settings())
    wanted = model.user_features
    if wanted is not None and hashed:
        wanted = [*wanted, *hashed]
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


def evaluated_users(held_out: list[set[int]], cap: int) -> np.ndarray:
    """Users with held-out items, the first ``cap`` of them (0: all) -> ``[B] int64``."""
    users = np.array([u for u, items in enumerate(held_out) if items], dtype=np.int64)
    return users[:cap] if cap else users


def evaluator(prep: Prepared, cfg: EvaluateConfig, split: str = "test") -> Any:
    """``model -> metrics`` on ``split`` ("test" or "validation"): builds the index (unless
    called with ``build=False``), then recall@K / NDCG@K on the split's held-out interactions
    (popularity baseline alongside) and the index's recall against exact search. Validation
    users are seen through their training history only (the validation items are what they
    did next), test users through training and validation; every item a user consumed
    before the split (not only the history window) is excluded from the model's and the
    baseline's recommendations."""
    k = cfg.k
    held_out = prep.test_items if split == "test" else prep.validation_items
    history = prep.history if split == "test" else prep.train.history
    seen = prep.seen if split == "test" else prep.train_seen
    users = evaluated_users(held_out, cfg.users)
    relevant = [held_out[u] for u in users]
    excluded = history[users] if seen is None else seen.rows(users).numpy()
    pop = ranking_metrics(
        popularity_recs(prep.train.item_ids, prep.dataset.num_items, excluded, k),
        relevant,
        k,
    )

    def evaluate(model: RetrievalModel, build: bool = True) -> dict[str, float]:
        if build:
            model.build_index(
                prep.train.item_features, prep.dataset.item_attributes, prep.tune_batch()
            )
        with torch.no_grad():  # not inference_mode: fbgemm's training op needs autograd keys
            batch = prep.user_batch(users, history=history, seen=seen)
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
    """A training run's model (kept weights, index built) and what it reports."""

    model: RetrievalModel
    prep: Prepared
    epoch_losses: list[float]
    evals: list[dict[str, float]]
    """Per epoch: the validation split's metrics (empty without a validation split)."""
    plan: EpochPlan
    """Training pairs, batch size and steps per epoch."""
    kept_epoch: int
    """The epoch whose weights the model holds (the best on validation, else the last)."""
    stopped_early: bool
    test: dict[str, float] | None = None
    """The test split's metrics on the kept weights (:func:`evaluate_test`)."""
    evaluated: dict[str, int] = field(default_factory=dict)
    """Users scored by each evaluation, and those left out by ``evaluate.users``."""
    sharding: dict[str, list[tuple[int, list[int], list[int]]]] | None = None
    """Under torchrun: each table's shards as (rank, offsets, sizes), TorchRec's plan."""

    def report(self) -> dict[str, Any]:
        """Everything but the model, as JSON-ready data (``metrics.json``)."""
        counts = self.prep.counts
        return {
            "epoch_losses": self.epoch_losses,
            "evals": self.evals,
            "kept_epoch": self.kept_epoch,
            "stopped_early": self.stopped_early,
            "test": self.test,
            "batch": {**asdict(self.plan), "unused_pairs": self.plan.unused_pairs},
            "split": asdict(counts) if counts is not None else None,
            "evaluated": self.evaluated,
            "sharding": self.sharding,
        }


def run_training(
    cfg: RunConfig, dist_ctx: DistContext | None = None, resume: Path | None = None
) -> RunResult:
    """Checks the config against the data, then trains; the model comes back with the kept
    epoch's weights and its index built (on rank 0), the test split not yet evaluated."""
    seed = cfg.train.seed
    ds = load_data(cfg.data)
    prep = prepare_run(ds, cfg.model, cfg.evaluate.validation)
    plan = check_run(cfg, prep)  # before any step: refusals name the field
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = RetrievalModel(prep.config)
    model.id_maps = ds.ids  # saved with the model: scoring reads and writes raw ids
    main = dist_ctx is None or dist_ctx.is_main
    validating = cfg.evaluate.validation > 0
    evaluate = evaluator(prep, cfg.evaluate, "validation") if main and validating else None
    stopper = EarlyStopping(f"recall@{cfg.evaluate.k}", cfg.evaluate.patience)
    trainer = Trainer(
        model, prep.train, cfg.train, evaluate, dist_ctx, stopper if validating else None
    )
    if resume is not None:
        trainer.resume(resume)
    trainer.fit()
    if main:
        model.build_index(prep.train.item_features, ds.item_attributes, prep.tune_batch())
        if model.seen_store is not None and prep.seen is not None:  # before the test split
            model.seen_store = SeenStore.from_sets(prep.seen)
    evaluated = {}
    if validating:
        val = evaluated_users(prep.validation_items, cfg.evaluate.users)
        evaluated["validation_users"] = len(val)
    return RunResult(
        model,
        prep,
        trainer.epoch_losses,
        trainer.evals,
        plan,
        trainer.kept_epoch,
        trainer.stopped,
        evaluated=evaluated,
        sharding=trainer.sharding,
    )


def evaluate_test(result: RunResult, cfg: EvaluateConfig) -> dict[str, float]:
    """The test split's metrics on the model as trained (its index as built); records them and
    the users scored in ``result``. Call it after saving the model: it may fail."""
    prep = result.prep
    users = evaluated_users(prep.test_items, cfg.users)
    with_test = prep.counts.users_in_test if prep.counts is not None else len(users)
    result.evaluated.update(test_users=len(users), test_users_over_cap=with_test - len(users))
    result.test = evaluator(prep, cfg, "test")(result.model, build=False)
    return result.test
