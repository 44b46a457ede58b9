"""A small model with its prepared data and request builders (the serving tests' fixture type;
a module of its own so test modules can import it: ``from tiny_model import Tiny``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from retrieval.model import RetrievalModel
from retrieval.training.prepare import Prepared
from serving import recommend_pb2
from serving.requests import RecRequest


@dataclass
class Tiny:
    prep: Prepared
    model: RetrievalModel

    def build(self, seed: int) -> RetrievalModel:
        """Another version: same config, different weights (so answers differ)."""
        torch.manual_seed(seed)
        m = RetrievalModel(self.prep.config)
        m.build_index(self.prep.train.item_features, self.prep.dataset.item_attributes)
        return m.eval()

    def request(self, user: int, k: int = 10, **kw: Any) -> RecRequest:
        ds, cfg = self.prep.dataset, self.prep.config
        hist = self.prep.history[user]
        return RecRequest(
            history=hist[hist >= 0].astype(np.int64),
            categorical=np.array([ds.user_features[n][user] for n in cfg.user_features], np.int64),
            dense=ds.user_dense[user].astype(np.float32),
            k=k,
            **kw,
        )

    def message(self, user: int, k: int = 10, **kw: Any) -> recommend_pb2.RecommendRequest:
        """The gRPC ``Recommend`` request of ``user`` (extra fields in ``kw``)."""
        r = self.request(user, k)
        return recommend_pb2.RecommendRequest(
            user_id=str(user),
            history=r.history.tolist(),
            categorical=r.categorical.tolist(),
            dense=r.dense.tolist(),
            k=k,
            **kw,
        )

    def inputs(self, users: np.ndarray, k: int = 10) -> dict[str, np.ndarray]:
        """The KServe tensors of ``users`` (``[B, ...]``, no filter)."""
        ds, cfg = self.prep.dataset, self.prep.config
        cat = np.stack([ds.user_features[n][users] for n in cfg.user_features], axis=1)
        return {
            "history": self.prep.history[users].astype(np.int64),
            "categorical": cat.astype(np.int64),
            "dense": ds.user_dense[users].astype(np.float32),
            "k": np.full((len(users), 1), k, dtype=np.int32),
        }

    def expected(
        self,
        model: RetrievalModel,
        users: np.ndarray,
        k: int,
        filters: list[str | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """In-process forward of ``users`` -> (ids, scores) as numpy."""
        with torch.inference_mode():
            ids, scores = model.eval()(self.prep.user_batch(users, filters), k)
        return ids.numpy(), scores.numpy()
