"""RetrievalModel: one module from a user's features to top-K item ids.

    features -> tables -> user tower -> index (filter inside the scan) -> score -> top-K

The item index is part of the module (buffers of :class:`IVFIndex`), so ``state_dict`` carries
the whole retrieval stack. Training uses the same tables and towers (``user_vectors`` /
``item_vectors``); :meth:`build_index` turns the item tower's output into the index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from retrieval.config import ModelConfig
from retrieval.features import UserBatch
from retrieval.filters import FilterBatch, filter_vocabulary
from retrieval.index.build import build_ivf
from retrieval.index.ivf import IVFIndex
from retrieval.index.plan import SearchParams
from retrieval.index.targets import check_targets
from retrieval.scoring import PairHead, score_candidates
from retrieval.seen_store import SeenStore
from retrieval.towers import HistoryAttention, Tower
from sharded_tables.collection import EmbeddingCollection, TableConfig
from sharded_tables.interface import TableCollection
from sharded_tables.planner import PlacementPlan
from sharded_tables.specs import DType, TableSpec
from sharded_tables.tiered import RemoteFetcher, TieredEmbeddingCollection

if TYPE_CHECKING:
    from retrieval.data.id_map import IdMaps


def table_configs(cfg: ModelConfig) -> list[TableConfig]:
    """The model's tables: items (read by the history and the item ids), one per user feature,
    one per item attribute."""
    e = cfg.embedding_dim
    item_features = ("history", "item_id") + (("recent",) if cfg.recent_len else ())
    item_features += ("history_seq",) if cfg.attention_len else ()
    tables = [TableConfig("item", cfg.num_items, e, features=item_features)]
    tables += [
        TableConfig(f"user_{n}", size, e, hashed=n in cfg.hashed_user_features)
        for n, size in cfg.user_features.items()
    ]
    tables += [
        TableConfig(f"attr_{n}", len(v), e, features=(f"item_{n}",))
        for n, v in cfg.item_attributes.items()
    ]
    return tables


def table_specs(
    cfg: ModelConfig, dtype: DType = DType.FP32, allowed: tuple[DType, ...] = ()
) -> list[TableSpec]:
    """The model's tables as planner input; the item table is read ``history_len`` times a user."""
    return [
        TableSpec(
            t.name,
            t.num_embeddings,
            t.dim,
            dtype=dtype,
            pooling=t.pooling,
            lookups_per_sample=(
                float(cfg.history_len + cfg.recent_len + cfg.attention_len)
                if t.name == "item"
                else 1.0
            ),
            allowed_dtypes=allowed,
            features=t.feature_names(),
            hashed=t.hashed,
        )
        for t in table_configs(cfg)
    ]


def _make_tables(
    cfg: ModelConfig, remote: RemoteFetcher | None, device: torch.device | str
) -> TableCollection:
    """Plain float tables, or the tiered ones the config's plan places."""
    if cfg.table_plan is None:
        return EmbeddingCollection(table_configs(cfg))
    plan = PlacementPlan.from_dict(cfg.table_plan)
    specs = [
        TableSpec(
            s.name,
            s.rows,
            s.dim,
            dtype=plan.placement(s.name).dtype,
            pooling=s.pooling,
            features=s.features,
            hashed=s.hashed,
        )
        for s in table_specs(cfg)
    ]
    return TieredEmbeddingCollection(specs, plan, device=device, remote=remote)


class RetrievalModel(nn.Module):
    """Two-tower retrieval with the item index inside.

    ``forward(batch, k) -> (item_ids [B, K] int64, scores [B, K] float32)``; ``-1`` / ``-inf``
    pad rows whose filter admits fewer than K items.
    """

    def __init__(
        self,
        config: ModelConfig,
        remote: RemoteFetcher | None = None,
        table_device: torch.device | str = "cpu",
    ):
        """``remote``: the embedding servers of remote tables; ``table_device``: where tiered
        tables are built (``cuda``: device tier in HBM, host tier in pinned DRAM). Tiered tables
        stay there when the module moves; their outputs follow the request's device."""
        super().__init__()
        config.validate()
        self.config = config
        self.user_feature_names = list(config.user_features)
        self.tables: TableCollection = _make_tables(config, remote, table_device)
        """Swappable (training puts its fused-optimizer tables here): callers use the
        :class:`~sharded_tables.interface.TableCollection` methods only."""
        e = config.embedding_dim
        parts = 1 + bool(config.recent_len) + bool(config.attention_len)
        user_in = e * (parts + len(config.user_features)) + config.dense_dim
        item_in = e * (1 + len(config.item_attributes))
        self.user_tower = Tower(user_in, config.hidden, config.out_dim)
        self.item_tower = Tower(item_in, config.hidden, config.out_dim)
        self.history_attention = (
            HistoryAttention(e, config.attention_len) if config.attention_len else None
        )
        self.head = (
            PairHead(config.out_dim, config.head_hidden, config.head_task_weights)
            if config.scoring_head
            else None
        )
        self.index = IVFIndex(
            config.index,
            config.out_dim,
            filter_vocabulary(config.item_attributes, config.numeric_attributes),
        )
        self.seen_store = SeenStore() if config.seen_store else None
        self.id_maps: IdMaps | None = None
        """The raw (the user's own) id of every dense user and item id, when the model was
        trained on imported data: saved in the model folder, so scoring and front ends map
        raw ids in (``id_maps.items.to_dense``) and answers out (``to_raw_lists``)."""

    # ---- towers (shared by training and serving) ----------------------------------------------
    def user_vectors(self, batch: UserBatch) -> torch.Tensor:
        """``batch`` -> query vectors ``q [B, D]``."""
        return self.user_tower_on(self.lookup(self.user_sparse(batch)), batch)

    def item_vectors(self, item_features: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Item features (``item_id [N, 1]``, ``item_<attr> [N, L]``) -> item vectors ``[N, D]``."""
        return self.item_tower_on(self.lookup(item_features))

    def lookup(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pooled embeddings of ``features {name: [B_f, L_f]}`` in ONE table call (a fused
        training table steps once per call): features with fewer rows are padded with empty
        bags to the longest, and each output is cut back to its own ``[B_f, E]``."""
        sizes = [t.shape[0] for t in features.values()]  # a list: dynamo traces it plainly
        rows = max(sizes) if sizes else 0
        if min(sizes, default=rows) == rows:
            return self.tables(features)
        padded = {
            f: torch.cat([t, t.new_full((rows - t.shape[0], t.shape[1]), -1)])
            for f, t in features.items()
        }
        pooled = self.tables(padded)
        return {f: pooled[f][: t.shape[0]] for f, t in features.items()}

    def user_sparse(self, batch: UserBatch) -> dict[str, torch.Tensor]:
        """The user side's table features: ``history [B, H]``, ``recent [B, recent_len]``
        (with ``recent_len``), ``user_<name> [B, 1]``."""
        sparse = {"history": batch.history}
        if self.config.recent_len:
            sparse["recent"] = batch.history[:, : self.config.recent_len]
        if self.config.attention_len:  # one bag per item: [B * L, 1]
            sparse["history_seq"] = batch.history[:, : self.config.attention_len].reshape(-1, 1)
        for j, name in enumerate(self.user_feature_names):
            sparse[f"user_{name}"] = batch.categorical[:, j : j + 1]
        return sparse

    def user_tower_on(self, pooled: Mapping[str, torch.Tensor], batch: UserBatch) -> torch.Tensor:
        """Pooled user features (+ the batch's dense features) -> ``q [B, D]``."""
        order = ["history"] + (["recent"] if self.config.recent_len else [])
        order += [f"user_{n}" for n in self.user_feature_names]
        parts = [pooled[f] for f in order]
        if self.history_attention is not None:
            hist = batch.history[:, : self.config.attention_len]  # [B, L]
            seq = pooled["history_seq"].view(*hist.shape, -1)  # [B, L, E]
            parts.append(self.history_attention(seq, hist >= 0, pooled["history"]))
        return self.user_tower([*parts, batch.dense])

    def item_tower_on(self, pooled: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Pooled item features -> item vectors ``[N, D]``. Training pools user and item
        features in ONE table call (a fused-optimizer table steps once per call)."""
        order = ["item_id"] + [f"item_{n}" for n in self.config.item_attributes]
        return self.item_tower([pooled[f] for f in order])

    # ---- serving ----------------------------------------------------------------------------
    def check_searchable(self) -> None:
        """Raises ``ValueError`` unless this model's index holds items to search."""
        if self.index.ntotal == 0:
            raise ValueError("the index is empty: build it (build_index) or load a built model")
        if self.index.item_ids.shape[0] != self.index.ntotal:
            raise ValueError(
                "this model's index is the router part of a document-sharded version (it holds "
                "statistics, no items): serve it as a router over its shard servers"
            )

    def validate(self, batch: UserBatch, k: int) -> None:
        """Edge validation of a request batch; raises ``ValueError`` naming the field."""
        b = batch.size
        cfg = self.config
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        self.check_searchable()
        if k > self.index.ntotal:
            raise ValueError(f"k={k} is larger than the catalog ({self.index.ntotal} items)")
        expect = {
            "categorical": ((b, len(cfg.user_features)), torch.int64, batch.categorical),
            "dense": ((b, cfg.dense_dim), torch.float32, batch.dense),
            "filter_negate": ((b, batch.filter_masks.shape[1]), torch.bool, batch.filter_negate),
        }
        if batch.history.dim() != 2 or batch.history.dtype != torch.int64:
            raise ValueError(
                f"history: expected int64 [B, H], got {batch.history.dtype} {tuple(batch.history.shape)}"
            )
        for name, (shape, dtype, t) in expect.items():
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"{name}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}"
                )
        _check_seen(batch.seen, b)
        if batch.recall_target is not None:
            check_targets(batch.recall_target, b)
        u = batch.user
        if u is not None and (u.dim() != 1 or u.shape[0] != b or u.dtype != torch.int64):
            raise ValueError(f"user: expected int64 [{b}], got {u.dtype} {list(u.shape)}")
        if u is not None and u.numel() and int(u.min()) < -1:
            raise ValueError(f"user: a user index is >= 0 (-1: none), got {int(u.min())}")
        w = self.index.schema.num_words
        if (
            batch.filter_masks.dim() != 3
            or batch.filter_masks.shape[::2] != (b, w)
            or batch.filter_masks.dtype != torch.int64
        ):
            raise ValueError(
                f"filter_masks: expected int64 [{b}, C, {w}], got {batch.filter_masks.dtype} {tuple(batch.filter_masks.shape)}"
            )
        fn = batch.filter_none
        if fn is not None and (fn.shape != batch.filter_masks.shape or fn.dtype != torch.int64):
            raise ValueError(
                f"filter_none: expected int64 {list(batch.filter_masks.shape)}, got {fn.dtype} "
                f"{list(fn.shape)}"
            )
        self.tables.validate(self.user_sparse(batch))
        if not torch.isfinite(batch.dense).all():
            raise ValueError("dense: contains NaN or infinity")

    def forward(
        self, batch: UserBatch, k: int, exact: bool = False, *, checked: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` items per request. ``exact=True`` scans every eligible item (the reference).
        ``checked=True``: the caller built ``batch`` from requests it validated with the same
        rules (serving's runner), so of :meth:`validate` (a pass over every request's fields)
        only the index check runs."""
        if checked:
            self.check_searchable()
        elif not torch.compiler.is_compiling():
            self.validate(batch, k)
        # features -> tables -> tower
        q = self.user_vectors(batch)  # [B, D]
        # index, with the request's filter and its seen items applied inside the scan
        r, fb = self.candidate_budget(batch, k)
        icfg = self.index.config  # as built (nprobe may be tuned)
        params = SearchParams(r, icfg.nprobe, icfg.rerank, exact, batch.recall_target)
        if self.head is None:  # ids and scores are the answer: no positions needed
            ids, dot = self.index.execute(q, fb, params)  # [B, R]
            return self.rank(q, ids, dot, None, k)
        pos, dot = self.index.execute(q, fb, params, positions=True)  # [B, R]
        ids = self.index.ids_at(pos)
        vecs = self.index.vectors_at(pos.clamp(min=0).flatten()).view(*pos.shape, -1)
        return self.rank(q, ids, dot, vecs, k)

    def candidate_budget(self, batch: UserBatch, k: int) -> tuple[int, FilterBatch]:
        """(candidates R the index returns, the batch's filter): R is K, or what the scoring
        head re-scores. The filter excludes the items the user has seen (``FilterBatch.exclude
        [B, H + S]``): the history window (with ``exclude_history``), the request's full seen
        list, if any, and what the seen store holds for its user. The index skips them inside
        its scan, so R does not grow with them."""
        seen = batch.history if self.config.exclude_history else batch.history[:, :0]
        if batch.seen is not None:
            seen = torch.cat([seen, batch.seen], dim=1)  # [B, H + S]
        if self.seen_store is not None and batch.user is not None:
            # the device path's rows have the store's fixed width: no host read of the batch's
            width = self.seen_store.widest if self.index.executor.backend == "device" else None
            seen = torch.cat([seen, self.seen_store.rows(batch.user, width)], dim=1)  # + stored
        r = min(
            self.index.ntotal, max(k, self.config.head_candidates if self.head is not None else 0)
        )
        exclude = seen if seen.shape[1] else None
        return r, dataclasses.replace(batch.filters, exclude=exclude)

    def rank(
        self,
        q: torch.Tensor,
        ids: torch.Tensor,
        dot: torch.Tensor,
        vecs: torch.Tensor | None,
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates -> top-``k``: the scoring head (when configured) over ``vecs [B, R, D]``.
        ``ids [B, R]`` (-1 pads), ``dot [B, R]`` from the index (best first), seen items
        already skipped."""
        if self.head is not None and vecs is not None:
            dot = score_candidates(q, vecs, dot, self.head, self.config.temperature).masked_fill(
                ids < 0, float("-inf")
            )
        elif dot.shape[1] == k:  # the index's top-k, best first, -1 / -inf padded: as it is
            return ids, dot
        top, idx = dot.topk(k, dim=1)
        return torch.where(top > float("-inf"), ids.gather(1, idx), torch.full_like(idx, -1)), top

    # ---- index build ------------------------------------------------------------------------
    @torch.no_grad()
    def catalog_vectors(
        self, item_features: Mapping[str, torch.Tensor], chunk: int = 65536
    ) -> torch.Tensor:
        """The item tower over the whole catalog ``{name: [N, L]}`` in chunks -> ``[N, D]``."""
        n = item_features["item_id"].shape[0]
        return torch.cat(
            [
                self.item_vectors({f: t[s : s + chunk] for f, t in item_features.items()})
                for s in range(0, n, chunk)
            ]
        )

    @torch.no_grad()
    def build_index(
        self,
        item_features: Mapping[str, torch.Tensor],
        item_attributes: Mapping[str, np.ndarray],
        tune_batch: UserBatch | None = None,
        chunk: int = 65536,
    ) -> None:
        """Item tower over the whole catalog -> IVF index (codes, lists, filter signatures).

        ``tune_batch``: sample requests whose query vectors tune nprobe (when the index config
        has ``target_recall``); the config's nprobe is updated to the tuned value."""
        vecs = self.catalog_vectors(item_features, chunk).cpu()
        tune = self.user_vectors(tune_batch).cpu() if tune_batch is not None else None
        self.index = build_ivf(
            vecs,
            self.config.index,
            item_attributes=item_attributes,
            attribute_values=filter_vocabulary(
                self.config.item_attributes, self.config.numeric_attributes
            ),
            tune_queries=tune,
        ).to(self.index.centroids.device)
        self.config.index = self.index.config


def _check_seen(seen: torch.Tensor | None, b: int) -> None:
    """Edge validation of a request's seen list ``[B, S] int64`` (ids >= 0, ``-1`` pads)."""
    if seen is None:
        return
    if seen.dim() != 2 or seen.shape[0] != b or seen.dtype != torch.int64:
        raise ValueError(f"seen: expected int64 [{b}, S], got {seen.dtype} {list(seen.shape)}")
    if seen.numel() and int(seen.min()) < -1:
        raise ValueError(f"seen: item ids are >= 0 (-1 pads), got {int(seen.min())}")
