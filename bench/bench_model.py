"""The model the serving and sharding benchmarks serve: one synthetic catalog, trained as
``recserve train`` trains it, its index's nprobe tuned for recall 0.97 on users' queries."""

from __future__ import annotations

import numpy as np
import torch

from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.training.prepare import Prepared, prepare
from retrieval.training.train import TrainConfig, train


def trained_model(users: int, items: int, epochs: int) -> tuple[Prepared, RetrievalModel]:
    """Synthetic catalog (seed 3) -> prepared data -> model trained ``epochs`` with its index,
    in eval mode. ``epochs = 0`` keeps untrained weights with nprobe tuned on item vectors
    (random towers put users nowhere near items: IVF's worst case)."""
    ds = generate(SyntheticConfig(num_users=users, num_items=items, seed=3))
    prep = prepare(ds)
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    if epochs:
        train(model, prep.train, TrainConfig(epochs=epochs, seed=0, progress=False))
        model.build_index(prep.train.item_features, ds.item_attributes, prep.tune_batch(seed=0))
    else:
        model.build_index(prep.train.item_features, ds.item_attributes)
    return prep, model.eval()


def user_inputs(prep: Prepared, user: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a request carries for ``user``: recent items ``int64 [H]`` (newest first, pads
    dropped), categorical feature codes ``int64 [F]`` and dense features ``float32 [Dd]``."""
    ds, cfg = prep.dataset, prep.config
    hist = prep.history[user]
    return (
        hist[hist >= 0].astype(np.int64),
        np.array([ds.user_features[n][user] for n in cfg.user_features], np.int64),
        ds.user_dense[user].astype(np.float32),
    )
