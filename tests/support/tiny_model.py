"""The serving tests' doubles: a small model with its prepared data and request builders
(:class:`Tiny`), and an in-memory stand-in for the model repository (:class:`StandInRepo`).
A module of its own so test modules can import them: ``from tiny_model import Tiny``."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrieval.model import RetrievalModel
from retrieval.seen_store import SeenStore
from retrieval.training.prepare import Prepared
from serving.protos import recommend_pb2
from serving.repository.manifest import CorruptVersionError
from serving.types import RecRequest


@dataclass
class Tiny:
    prep: Prepared
    model: RetrievalModel

    def with_seen_store(self) -> RetrievalModel:
        """A copy of the model keeping every user's items before the test split (its own store:
        the session's model stays without one)."""
        m = copy.deepcopy(self.model).eval()
        m.config.seen_store = True
        assert self.prep.seen is not None
        m.seen_store = SeenStore.from_sets(self.prep.seen)
        return m

    def build(self, seed: int) -> RetrievalModel:
        """Another version: same config, different weights (so answers differ)."""
        torch.manual_seed(seed)
        m = RetrievalModel(self.prep.config)
        m.build_index(self.prep.train.item_features, self.prep.dataset.item_attributes)
        return m.eval()

    def request(self, who: int, /, k: int = 10, **kw: Any) -> RecRequest:
        """The request of user ``who`` (``kw``: more fields, ``user=`` too)."""
        ds, cfg = self.prep.dataset, self.prep.config
        user = who
        hist = self.prep.history[user]
        return RecRequest(
            history=hist[hist >= 0].astype(np.int64),
            categorical=np.array([ds.user_features[n][user] for n in cfg.user_features], np.int64),
            dense=ds.user_dense[user].astype(np.float32),
            k=k,
            **kw,
        )

    def message(self, who: int, /, k: int = 10, **kw: Any) -> recommend_pb2.RecommendRequest:
        """The gRPC ``Recommend`` request of user ``who`` (extra fields in ``kw``, ``user=``
        too)."""
        user = who
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
            batch = self.prep.user_batch(users, filters, schema=model.index.schema)
            ids, scores = model.eval()(batch, k)
        return ids.numpy(), scores.numpy()


@dataclass
class Loaded:
    name: str
    version: int
    model: RetrievalModel
    config: Any = None
    path: Path | None = None
    shard_map: Any = None
    sequence: int = 0


def start_server(config: Any, model: RetrievalModel, **kw: Any) -> Any:
    """A started in-process server (``serving.app.server.Server``, ``kw``: its keyword options)
    over a stand-in repository holding ``model`` as version 1."""
    from serving.app.server import Server

    repo = StandInRepo()
    repo.publish(model)
    s = Server(config, repo=repo, **kw)
    s.start()
    return s


class StandInRepo:
    """The three methods of ``ModelRepository`` the server uses, over models in memory."""

    def __init__(self, name: str = "demo"):
        self.name = name
        self.models: dict[int, RetrievalModel] = {}
        self.corrupt: set[int] = set()
        self.loads: list[int] = []
        self._lock = threading.Lock()

    def publish(self, model: RetrievalModel, corrupt: bool = False) -> int:
        with self._lock:
            v = max(self.models, default=0) + 1
            self.models[v] = model
            if corrupt:
                self.corrupt.add(v)
            return v

    def latest(self, name: str) -> int | None:
        return max(self.versions(name), default=None)

    def versions(self, name: str) -> list[int]:
        with self._lock:
            return sorted(self.models) if name == self.name else []

    def load(self, name: str, version: int | None = None) -> Loaded:
        v = self.latest(name) if version is None else version
        self.loads.append(v or 0)
        if name != self.name or v not in self.models:
            raise FileNotFoundError(f"no version {v} of {name}")
        if v in self.corrupt:
            raise CorruptVersionError(f"{name}/{v}: model.pt checksum mismatch")
        return Loaded(name, v, self.models[v])
