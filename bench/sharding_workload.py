"""bench/sharding.py's workload: one synthetic catalog, one model trained as ``recserve train``
trains it (nprobe tuned on users' queries), the requests every case sends, and the versions the
cases publish (plain, document-sharded, and sharded with the coldest tables on an embedding
server)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_model import trained_model, user_inputs

from retrieval.features import UserBatch
from retrieval.model import RetrievalModel, table_specs
from retrieval.tiering import tier_model
from retrieval.training.prepare import Prepared
from serving.protos import recommend_pb2
from serving.repository.repository import ModelRepository
from serving.sharding.router import first_round
from serving.sharding.wire import encode_request
from serving.types import RecRequest
from sharded_tables.placement import Budgets
from sharded_tables.planner import plan
from sharded_tables.specs import DType, Tier

MODEL = "bench"
NO_FILTER = "none"


@dataclass
class Workload:
    """The model, its data and the requests every case sends."""

    prep: Prepared
    model: RetrievalModel
    users: np.ndarray
    """Users of the requests, cycled through in order."""
    k: int
    filters: dict[str, str | None]
    """Label -> filter text (None: unfiltered)."""

    def batch(self, users: np.ndarray, label: str) -> UserBatch:
        """The in-process input of ``users``, all with the filter ``label``."""
        return self.prep.user_batch(users, [self.filters[label]] * len(users))

    def request(self, user: int, label: str) -> RecRequest:
        """What the server makes of a ``Recommend`` call (as ``tests/support/serving_fixtures.py``)."""
        history, categorical, dense = user_inputs(self.prep, user)
        return RecRequest(
            history=history,
            categorical=categorical,
            dense=dense,
            k=self.k,
            filter=self.filters[label],
        )

    def message(self, user: int, label: str) -> recommend_pb2.RecommendRequest:
        """The gRPC ``Recommend`` request of ``user``."""
        r = self.request(user, label)
        return recommend_pb2.RecommendRequest(
            user_id=str(user),
            history=r.history.tolist(),
            categorical=r.categorical.tolist(),
            dense=r.dense.tolist(),
            k=self.k,
            filter=r.filter or "",
        )

    def payloads(self, label: str) -> list[bytes]:
        """Every request user's serialized ``Recommend`` with the filter ``label``."""
        return [self.message(int(u), label).SerializeToString() for u in self.users]

    def search_payloads(self, label: str) -> list[bytes]:
        """Every request user's first ``Shard.Search`` as a router sends it for this model
        (one user; ``serving/sharding/router.py``'s ``first_round``), serialized."""
        out = []
        with torch.inference_mode():
            for u in self.users:
                b = self.batch(np.array([u]), label)
                q = self.model.user_vectors(b)
                fb, rounds = first_round(self.model, b, q, self.k)
                msg = encode_request(MODEL, 1, q, fb, rounds, self.model.head is not None)
                out.append(msg.SerializeToString())
        return out

    def expected(self, users: np.ndarray, label: str) -> tuple[np.ndarray, np.ndarray]:
        """In-process unsharded answer of ``users`` -> (ids, scores)."""
        with torch.inference_mode():
            ids, scores = self.model(self.batch(users, label), self.k)
        return ids.numpy(), scores.numpy()


def build_workload(args: argparse.Namespace) -> Workload:
    """The synthetic catalog and its model trained ``--epochs`` (``bench_model.trained_model``,
    as ``bench/serving.py`` builds it)."""
    prep, model = trained_model(args.users, args.items, args.epochs)
    return Workload(
        prep,
        model,
        np.arange(args.request_users),
        args.k,
        {NO_FILTER: None, args.filter: args.filter},
    )


def coldest_remote_budgets(model: RetrievalModel) -> Budgets:
    """Budgets that keep the hottest table (most lookups per byte: the item table, read
    ``history_len`` times a user) in the host tier and put every other table on one embedding
    server, exactly (FP32: the answers stay equal to the unsharded model's). The remote tables'
    hot-row caches get a budget of their own (``Budgets.cache``), at the default size
    (``cache_fraction`` of each table's rows): without it they would take host room the item
    table fills, and get none."""
    specs = table_specs(model.config, DType.FP32)
    hottest = max(specs, key=lambda s: (s.lookups_per_sample / s.row_bytes(), s.name))
    rest = sum(s.bytes(DType.FP32) for s in specs if s is not hottest)
    return Budgets(
        device=0,
        host=hottest.bytes(DType.FP32),
        remote_per_server=2 * rest + (1 << 20),
        remote_servers=1,
        cache=rest,  # room for any cache_fraction of the remote tables' rows
    )


def publish_remote(root: Path, work: Workload, shards: int) -> dict[str, Any]:
    """Publishes ``shards`` document shards whose coldest tables live on one embedding server
    (as ``tests/recserve/test_cluster_follow.py``); returns the version and the remote tables."""
    placement = plan(table_specs(work.model.config, DType.FP32), coldest_remote_budgets(work.model))
    tiered, rows = tier_model(work.model, placement=placement)
    remote = [p.table for p in placement.tables if p.tier is Tier.REMOTE]
    version = ModelRepository(root).publish(MODEL, tiered, shards=shards, remote_rows=rows)
    return {"version": version, "remote_tables": remote}
