"""model_repo fixtures: a tiny model (untrained towers, real index) built once per session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.training.prepare import Prepared, prepare
from serving.repository.repository import ModelRepository


@dataclass
class Tiny:
    prep: Prepared
    model: RetrievalModel

    def build(self, seed: int) -> RetrievalModel:
        """Another model of the same config with different weights (answers differ)."""
        torch.manual_seed(seed)
        m = RetrievalModel(self.prep.config)
        m.build_index(self.prep.train.item_features, self.prep.dataset.item_attributes)
        return m.eval()

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


@pytest.fixture(scope="session")
def tiny() -> Tiny:
    ds = generate(SyntheticConfig(num_users=100, num_items=300, seed=1))
    prep = prepare(ds, history_len=8)
    t = Tiny(prep, None)  # type: ignore[arg-type]
    t.model = t.build(0)
    return t


@pytest.fixture
def repo(tmp_path: Path) -> ModelRepository:
    return ModelRepository(tmp_path / "repo")
