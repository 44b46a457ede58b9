"""The model's configuration: one typed object, saved beside the weights (``config.json``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from retrieval.index.ivf import IVFConfig


@dataclass
class ModelConfig:
    """Shapes of the towers and tables, the index settings and the scoring stage."""

    num_items: int
    """Rows of the item table (item ids are ``0 .. num_items - 1``)."""
    user_features: dict[str, int]
    """Categorical user feature -> vocabulary size (one id per user); for a feature named in
    ``hashed_user_features``: the rows of its working table in training."""
    dense_dim: int
    """Dense user features per user."""
    item_attributes: dict[str, list[str]]
    """Item attribute -> values; they feed the item tower and the eligibility filter."""
    embedding_dim: int = 32
    """Width of every embedding table."""
    hidden: tuple[int, ...] = (128,)
    """Hidden layer widths of both towers."""
    out_dim: int = 64
    """Width D of query and item vectors (L2-normalized)."""
    history_len: int = 50
    """Most recent items of a user's history that the user tower reads."""
    recent_len: int = 5
    """The user tower also pools the newest ``recent_len`` of those items on their own: what
    the user did last weighs apart from the long history (a position-aware tower; 0: off; the
    whole window when ``history_len`` is shorter). A saved config without the field (written
    before it existed) loads as 0."""
    attention_len: int = 0
    """The newest ``attention_len`` history items also go through self-attention with their
    positions (``towers.HistoryAttention``: a sequence-aware tower); 0: off."""
    seen_store: bool = False
    """The model keeps every known user's seen items (``retrieval/seen_store.py``): a request
    that names its user (``UserBatch.user``) has them excluded without sending them. Filled at
    training, grown by live updates."""
    exclude_history: bool = True
    """Never recommend an item already in the request's history (the window the tower reads); a
    request's full seen list (``UserBatch.seen``) is excluded whatever this says."""
    temperature: float = 0.05
    """Softmax temperature of training logits (q · v / temperature)."""
    scoring_head: bool = False
    """Add a learned head over (query, item) pairs to the dot product of re-ranked candidates."""
    head_hidden: int = 64
    head_tasks: tuple[str, ...] = ("engagement",)
    """Task outputs of the head; combined into one value with ``head_task_weights``."""
    head_task_weights: tuple[float, ...] = (1.0,)
    head_candidates: int = 200
    """Candidates the head re-scores (at least K + history length)."""
    hashed_user_features: tuple[str, ...] = ()
    """User features whose values are raw 64-bit ids (any int64; -1: none), not codes: their
    tables are keyed by id (``sharded_tables/hashed_training.py`` trains them over a working
    table and the embedding servers)."""
    index: IVFConfig = field(default_factory=IVFConfig)
    table_plan: dict[str, Any] | None = None
    """Tiered, quantized tables: a :class:`sharded_tables.planner.PlacementPlan` as a dict.
    ``None``: plain float tables in the process (what training uses)."""

    def validate(self) -> None:
        if self.num_items < 1 or self.out_dim < 1 or self.embedding_dim < 1:
            raise ValueError("num_items, out_dim and embedding_dim must be >= 1")
        if self.recent_len < 0 or self.attention_len < 0:
            raise ValueError(
                f"recent_len, attention_len: must be >= 0, got {self.recent_len}, {self.attention_len}"
            )
        if len(self.head_tasks) != len(self.head_task_weights):
            raise ValueError("head_tasks and head_task_weights must have the same length")
        unknown = sorted(set(self.hashed_user_features) - set(self.user_features))
        if unknown:
            raise ValueError(
                f"hashed_user_features: {unknown} are not user features "
                f"(known: {sorted(self.user_features)})"
            )
        self.index.validate()
        if self.table_plan is not None:
            from sharded_tables.planner import PlacementPlan

            PlacementPlan.from_dict(self.table_plan)  # raises naming the bad field

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"model config: unknown fields {sorted(unknown)}")
        d = dict(d)
        d.setdefault("recent_len", 0)  # saved before the field existed: those towers had none
        d["index"] = IVFConfig(**d.get("index", {}))
        for key in ("hidden", "head_tasks", "head_task_weights", "hashed_user_features"):
            if key in d:
                d[key] = tuple(d[key])
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: Path) -> ModelConfig:
        return cls.from_dict(json.loads(path.read_text()))
