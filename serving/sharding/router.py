"""The router: Recommend in front of document shard servers.

A batch runs the user tower once here (tables possibly on embedding servers), plans the search
with the catalog's statistics, sends the query vectors to every shard in parallel, and merges
their candidates exactly (``retrieval/index/search.py``)::

    q = tower(features)                       [B, D]   here
    plan = stats.plan(filters, q)                      here: the whole catalog's statistics
    shard s: candidates(q, filters, plan)     [B, r]   every shard, in parallel, one deadline
    select(concat(candidates))                [B, R]   here: equals the unsharded top-R
    head, top-K                               [B, K]   here

A shard that misses the deadline or fails (down, wrong version) leaves the answer **partial**:
the result of the shards that answered, flagged with the missing shards, never an error reported
as a full success and never a hang. When every shard fails the batch is UNAVAILABLE. Replicas,
failover, hedging and ejection are the shard client's (``serving/sharding/shard_client.py``);
its metrics are in ``serving/sharding/router_metrics.py``.

Versions: the router serves only a version that every reachable shard holds
(:class:`ShardedRepository`), so during a rollout it stays on the old version until the shards
have the new one, and refuses shards of another model or another shard layout. Likewise it
waits for the embedding servers (``router.embedding_servers``) to hold the new version's rows,
and its lookups name the version it serves, so each batch reads the rows of its own version.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from common.grpc_util import ClientAuth
from retrieval.artifact import CONFIG_FILE
from retrieval.config import ModelConfig
from retrieval.features import UserBatch
from retrieval.filters import FilterBatch
from retrieval.format import load_config
from retrieval.index.plan import SearchParams, SearchPlan
from retrieval.index.search import Candidates, run_search
from retrieval.model import RetrievalModel, table_specs
from serving.engine.runner import ModelRunner
from serving.repository.repository import ARTIFACT_DIR, LoadedModel, ModelRepository
from serving.sharding.config import RouterConfig
from serving.sharding.shard_client import INFO_TIMEOUT_S, ShardClient
from serving.sharding.wire import decode_response, encode_request
from serving.types import UnavailableError
from sharded_tables.export import remote_routing
from sharded_tables.planner import PlacementPlan
from sharded_tables.remote.client import EmbeddingVersions, RemoteTables
from sharded_tables.specs import Tier


def first_round(
    model: RetrievalModel, batch: UserBatch, q: torch.Tensor, k: int
) -> tuple[FilterBatch, SearchPlan]:
    """What a routed batch asks every shard first: the filters (seen items excluded on every
    shard) and the plan, made here from the whole catalog's statistics. ``q [B, D]``: the
    batch's user vectors (bounds for a second round); recall targets give each row its own
    nprobe and bound slack."""
    r, fb = model.candidate_budget(batch, k)
    icfg = model.index.config
    params = SearchParams(r, icfg.nprobe, icfg.rerank, target=batch.recall_target)
    plan = model.index.plan(fb, params, q=q)
    return fb, plan


WARMUP_ROUND_S = 120.0
"""How long a warm-up round waits for the shards. A warm-up batch (8 rows, filtered ones too)
on a large catalog can outlast the user-facing shard deadline (a catalog of millions of items
on a small host missed the default one), and a miss would refuse the version; the warm-up is no
user's request."""


class RouterRunner(ModelRunner):
    """A :class:`ModelRunner` whose index search runs on the shards."""

    def __init__(
        self,
        model: RetrievalModel,
        name: str,
        version: int,
        client: ShardClient,
        sequence: int = 0,
    ):
        """``sequence``: the live updates ``model`` has (the shards answer from that state)."""
        super().__init__(model, name, version)
        self.graphed = None  # the search runs on the shards: no whole-forward graph here
        self.client, self.sequence = client, sequence
        # Batches overlap only while they wait on shards: the tables' hot-row caches are not
        # safe for two forwards at once, so the tower runs one batch at a time.
        self._tower = threading.Lock()
        self._round_s: float | None = None  # set while warming up: WARMUP_ROUND_S

    def warmup(self, batch_sizes: tuple[int, ...] = (1, 8)) -> None:
        """:meth:`ModelRunner.warmup` with each round given ``WARMUP_ROUND_S`` (runs before the
        version serves, so no request shares this runner meanwhile)."""
        self._round_s = WARMUP_ROUND_S
        try:
            super().warmup(batch_sizes)
        finally:
            self._round_s = None

    def forward(
        self, batch: UserBatch, k: int, deadline: float | None
    ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        model = self.model
        with self._tower:
            q = model.user_vectors(batch)  # [B, D]
        fb, plan = first_round(model, batch, q, k)
        with_vectors = model.head is not None
        wait = self._round_s or self.client.timeout(deadline)
        until = time.monotonic() + wait  # one deadline for all rounds
        failed: dict[int, str] = {}

        def fetch(p: Any, rows: torch.Tensor | None) -> Candidates:
            qq, f = (q, fb) if rows is None else (q[rows], fb.rows(rows))
            request = encode_request(self.name, self.version, qq, f, p, with_vectors, self.sequence)
            left = max(until - time.monotonic(), 0.001)
            answers, errors = self.client.search(request, left, skip=set(failed))
            failed.update(errors)
            if not answers:
                why = "; ".join(f"shard {s}: {e}" for s, e in sorted(failed.items()))
                raise UnavailableError(f"no shard answered ({why})")
            parts = [decode_response(answers[s], qq.shape[0], qq.shape[1]) for s in sorted(answers)]
            return Candidates.concat(parts)

        top = run_search(plan, fetch)
        dev = q.device
        vecs = None if top.vectors is None else top.vectors.to(dev)
        ids, scores = model.rank(q, top.keys.to(dev), top.scores.to(dev), vecs, k)
        if failed:
            self.client.metrics.partial.labels(self.name).inc()
        return ids, scores, [f"shard-{s}" for s in sorted(failed)]


class ShardedRepository:
    """A :class:`ModelRepository` as the router sees it: only versions every shard holds; a
    loaded version gets its remote tables' embedding servers and is checked against the shard
    layout."""

    def __init__(
        self,
        repo: ModelRepository,
        client: ShardClient,
        config: RouterConfig,
        upstream: ClientAuth | None = None,
    ):
        self.repo, self.client, self.config = repo, client, config
        self.upstream = upstream
        self.remotes: list[RemoteTables] = []
        self.embedding = EmbeddingVersions(config.embedding_servers, upstream)

    def versions(self, name: str) -> list[int]:
        held = set(self.client.common_versions(name))
        rows = self.embedding.held(INFO_TIMEOUT_S)  # None: unversioned embedding servers, or none
        return [v for v in self.repo.versions(name) if v in held and (rows is None or v in rows)]

    def latest(self, name: str) -> int | None:
        return max(self.versions(name), default=None)

    def load(self, name: str, version: int | None = None) -> LoadedModel:
        vdir = self.repo.verified_dir(name, version)
        cfg = load_config(vdir / ARTIFACT_DIR / CONFIG_FILE)
        remote = self._remote_tables(cfg, int(vdir.name))
        loaded = self.repo.load(name, int(vdir.name), remote=remote)
        smap = loaded.shard_map
        if smap is None:
            raise ValueError(
                f"{name} version {loaded.version} is not document-sharded: serve it without [router]"
            )
        if smap.num_shards != self.client.num_shards:
            raise ValueError(
                f"router.shards: {self.client.num_shards} shards configured, but {name} version "
                f"{loaded.version} has {smap.num_shards}"
            )
        return loaded

    def _remote_tables(self, cfg: ModelConfig, version: int) -> RemoteTables | None:
        if cfg.table_plan is None:
            return None
        plan = PlacementPlan.from_dict(cfg.table_plan)
        if not any(p.tier is Tier.REMOTE for p in plan.tables):
            return None
        try:
            routing = remote_routing(plan, table_specs(cfg), self.config.embedding_servers)
        except ValueError as e:
            raise ValueError(
                f"router.embedding_servers: version {version} has remote tables ({e}); "
                f"{len(self.config.embedding_servers)} addresses given"
            ) from None
        timeout = self.config.embedding_timeout_ms / 1000.0
        remote = RemoteTables(
            routing,
            timeout=timeout,
            auth=self.upstream,
            version=version,
            hold_bytes=self.config.embedding_hold_bytes,
        )
        self.remotes.append(remote)
        try:
            remote.hold()  # before the version serves; a server down now fails the load
        except BaseException:
            remote.close()
            self.remotes.remove(remote)
            raise
        return remote

    def close(self) -> None:
        for r in self.remotes:
            r.close()
        self.embedding.close()
        self.client.close()


def make_router(
    repo: ModelRepository,
    model: str,
    config: RouterConfig,
    registry: CollectorRegistry,
    upstream: ClientAuth | None = None,
) -> tuple[ShardedRepository, Callable[[LoadedModel], RouterRunner]]:
    """-> (the repository the model host reads, its ``make_runner``). ``upstream``: TLS and the
    token for the calls to shard and embedding servers (``Security.upstream``)."""
    client = ShardClient(config, model, registry, upstream)
    sharded = ShardedRepository(repo, client, config, upstream)

    def make_runner(loaded: LoadedModel) -> RouterRunner:
        return RouterRunner(loaded.model, model, loaded.version, client, loaded.sequence)

    return sharded, make_runner
