"""``recserve train --config train.toml``: data -> model -> training -> evaluation -> model folder.

Example ``train.toml`` (every table optional; unknown keys are refused naming the field)::

    [data]
    source = "synthetic"        # or "movielens" (data_dir = "data/ml-100k")
    num_users = 2000            # synthetic only: any SyntheticConfig field
    num_items = 5000

    [model]                     # ModelConfig fields, e.g.
    embedding_dim = 32
    out_dim = 64
    user_features = ["age_bucket", "country"]   # a subset of the data's user features

    [train]                     # TrainConfig fields (retrieval/training/train.py)
    epochs = 5
    batch_size = 512
    table_optimizer = "rowwise_adagrad"

    [evaluate]
    k = 100
    users = 2000                # held-out users evaluated after each epoch (0: all)

    [publish]                   # read by the CLI: publish into a model repository
    model_repo = "runs/train/model_repo"
    name = "demo"
    shards = 0                  # > 0: document shards
    table_dtype = "int8"        # the served tables' dtype (fp32, fp16, fp8, int8, int4)

Under torchrun every rank trains its part (``retrieval/training/distributed.py``); rank 0
evaluates and writes the result.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrieval.config import ModelConfig
from retrieval.data import RecDataset, SyntheticConfig, generate, load_movielens
from retrieval.index.exact import recall_at_k
from retrieval.index.ivf import IVFConfig
from retrieval.metrics import popularity_recs, ranking_metrics
from retrieval.model import RetrievalModel
from retrieval.training.distributed import DistContext
from retrieval.training.prepare import Prepared, prepare
from retrieval.training.train import TrainConfig, Trainer

TABLES = ("data", "model", "train", "evaluate", "publish")
DERIVED = frozenset({"num_items", "item_attributes", "dense_dim"})
"""ModelConfig fields that come from the data, never from ``[model]``."""


@dataclass
class RunConfig:
    data: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: dict[str, Any] = field(default_factory=dict)
    publish: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_toml(cls, path: Path) -> RunConfig:
        """Reads and checks ``path`` (keys and value types of every table but ``[publish]``,
        which the CLI checks; ranges of ``[train]`` and ``[evaluate]``) before any work;
        ``ValueError`` naming the table and key."""
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))  # TOML is UTF-8
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"--config: cannot read {path}: {e}") from None
        except RecursionError:  # tomllib recurses once per level of nested arrays and tables
            raise ValueError(f"--config: cannot read {path}: nested too deep") from None
        unknown = sorted(set(raw) - set(TABLES))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown table (known: {list(TABLES)})")
        for t in TABLES:
            if not isinstance(raw.get(t, {}), dict):
                raise ValueError(f"{t}: expected a table")
        check_data(raw.get("data", {}))
        check_model(raw.get("model", {}))
        check_types("train", raw.get("train", {}), TrainConfig)
        check_evaluate(raw.get("evaluate", {}))
        return cls(
            data=raw.get("data", {}),
            model=raw.get("model", {}),
            train=TrainConfig.from_dict(raw.get("train", {})),
            evaluate=raw.get("evaluate", {}),
            publish=raw.get("publish", {}),
        )


# ---- checks of the tables (types here; each config's own validate checks ranges) -----------
def check_types(
    table: str, data: dict[str, Any], cls: type, skip: frozenset[str] = frozenset()
) -> None:
    """Refuses a key ``cls`` has no field for (or one in ``skip``) and a value of another type
    than the field's; ``ValueError`` naming ``table.key``."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)} - skip
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"{table}.{key}: unknown key (known: {sorted(known)})")
        if not _fits(value, hints[key]):
            raise ValueError(f"{table}.{key}: expected {_type_name(hints[key])}, got {value!r:.60}")


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(value, a) for a in args if a is not type(None))
    if hint is Any or origin is dict or hint is dict:
        return hint is Any or isinstance(value, dict)
    if origin in (tuple, list):
        if not isinstance(value, list):
            return False
        if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):
            return len(value) == len(args) and all(map(_fits, value, args))
        return all(_fits(v, args[0]) for v in value)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, str if hint is Path else hint)


def _type_name(hint: Any) -> str:
    if typing.get_args(hint):  # e.g. "tuple[int, int]", "Path | None"
        return str(hint).replace("typing.", "").replace("pathlib.", "")
    return getattr(hint, "__name__", str(hint))


def check_data(spec: dict[str, Any]) -> None:
    """``[data]``: ``source`` and the keys of that source."""
    spec = dict(spec)
    source = spec.pop("source", "synthetic")
    if source == "movielens":
        for key, value in spec.items():
            if key != "data_dir":
                raise ValueError(f"data.{key}: unknown key for movielens")
            if not isinstance(value, str):
                raise ValueError(f"data.data_dir: expected a path, got {value!r:.60}")
    elif source == "synthetic":
        check_types("data", spec, SyntheticConfig)
    else:
        raise ValueError(f"data.source: 'synthetic' or 'movielens', got {source!r:.60}")


def check_model(spec: dict[str, Any]) -> None:
    """``[model]``: ModelConfig fields but the derived ones; ``user_features`` names a subset of
    the data's features; ``index`` is a table of IVFConfig fields."""
    spec = dict(spec)
    wanted = spec.pop("user_features", [])
    if not (isinstance(wanted, list) and all(isinstance(f, str) for f in wanted)):
        raise ValueError(f"model.user_features: expected a list of names, got {wanted!r:.60}")
    check_types("model", spec, ModelConfig, skip=DERIVED)
    check_types("model.index", spec.get("index", {}), IVFConfig)


def check_evaluate(spec: dict[str, Any]) -> None:
    """``[evaluate]``: ``k`` (>= 1) and ``users`` (>= 0, 0: all)."""
    for key, value in spec.items():
        if key not in ("k", "users"):
            raise ValueError(f"evaluate.{key}: unknown key (known: ['k', 'users'])")
        least = 1 if key == "k" else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"evaluate.{key}: must be an int >= {least}, got {value!r:.60}")


def load_data(spec: dict[str, Any]) -> RecDataset:
    """``[data]`` -> a dataset (errors name the field)."""
    spec = dict(spec)
    source = spec.pop("source", "synthetic")
    if source == "movielens":
        data_dir = Path(spec.pop("data_dir", "data/ml-100k"))
        if spec:
            raise ValueError(f"data.{sorted(spec)[0]}: unknown key for movielens")
        return load_movielens(data_dir)
    if source != "synthetic":
        raise ValueError(f"data.source: 'synthetic' or 'movielens', got {source!r}")
    known = {f.name for f in fields(SyntheticConfig)}
    bad = sorted(set(spec) - known)
    if bad:
        raise ValueError(f"data.{bad[0]}: unknown key (known: {sorted(known)})")
    return generate(SyntheticConfig(**spec))


def prepare_run(ds: RecDataset, model_spec: dict[str, Any]) -> Prepared:
    """The dataset and ``[model]`` -> prepared inputs and a validated model config."""
    spec = dict(model_spec)
    known = {f.name for f in fields(ModelConfig)} - {"num_items", "item_attributes", "dense_dim"}
    bad = sorted(set(spec) - known)
    if bad:
        raise ValueError(f"model.{bad[0]}: unknown or derived key (settable: {sorted(known)})")
    wanted = spec.pop("user_features", None)
    history_len = spec.pop("history_len", 50)
    for key in ("hidden", "head_tasks", "head_task_weights"):
        if key in spec:
            spec[key] = tuple(spec[key])
    prep = prepare(ds, history_len=history_len, **spec)
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


def evaluator(prep: Prepared, spec: dict[str, Any]) -> Any:
    """``model -> metrics``: builds the index, then recall@K / NDCG@K on held-out interactions
    (popularity baseline alongside) and the index's recall against exact search."""
    k = int(spec.get("k", 100))
    users = np.array([u for u in range(prep.dataset.num_users) if prep.test_items[u]])
    limit = int(spec.get("users", 2000))
    if limit:
        users = users[:limit]
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
