"""The model's configuration: one typed object, saved beside the weights (``config.json``).

:class:`ModelSettings` is what a person chooses (``train.toml``'s ``[model]`` is that class, with
two training knobs: ``retrieval/training/config.py``); :class:`ModelConfig` adds what the data
decides (catalog size, features, attributes) and what publishing adds (the table plan). Every
field is declared once, here, with its constraints and its docstring. Importing this module
loads no torch (a config check must stay cheap).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator

from common.config import Config
from retrieval.index.config import IVFConfig

MODEL_FORMAT = 1
"""Format of a model folder this code writes (``config.json``'s ``format``, and ``model.pt``'s:
``retrieval/format.py`` migrates older ones)."""


def _tuple(value: Any) -> Any:
    """TOML and JSON give lists where the config holds tuples."""
    return tuple(value) if isinstance(value, list) else value


def _plain(value: Any) -> Any:
    """Values taken from data (NumPy scalars) as Python's; a file's values pass unchanged."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value.item() if type(value).__module__ == "numpy" else value


PositiveInt = Annotated[int, Field(ge=1)]
FromData = BeforeValidator(_plain)
"""What the data decides is built by code from arrays: their scalars are accepted."""
Widths = Annotated[tuple[PositiveInt, ...], BeforeValidator(_tuple)]
Names = Annotated[tuple[str, ...], BeforeValidator(_tuple)]
Weights = Annotated[tuple[float, ...], BeforeValidator(_tuple)]
Value = str | int | bool
"""An attribute value as saved: text, or an integer / boolean standing for its text."""


class ModelSettings(Config):
    """The towers', the head's and the index's settings: ``[model]`` (``[model.index]``)."""

    embedding_dim: PositiveInt = 32
    """Width of every embedding table."""
    hidden: Widths = (128,)
    """Hidden layer widths of both towers."""
    out_dim: PositiveInt = 64
    """Width D of query and item vectors (L2-normalized)."""
    history_len: PositiveInt = 50
    """Most recent items of a user's history that the user tower reads."""
    recent_len: int = Field(default=5, ge=0)
    """The user tower also pools the newest ``recent_len`` of those items on their own: what
    the user did last weighs apart from the long history (a position-aware tower; 0: off; the
    whole window when ``history_len`` is shorter). ``bench/quality.py`` measures what it adds."""
    attention_len: int = Field(default=0, ge=0)
    """The newest ``attention_len`` history items also go through self-attention with their
    positions (``towers.HistoryAttention``: a sequence-aware tower); 0: off."""
    seen_store: bool = False
    """The model keeps every known user's seen items (``retrieval/seen_store.py``; what they
    consumed before the test split, 8 bytes an interaction): a request that names its user
    (``UserBatch.user``) has them excluded without sending them. Filled at training, grown by
    live updates."""
    exclude_history: bool = True
    """Never recommend an item already in the request's history (the window the tower reads); a
    request's full seen list (``UserBatch.seen``) is excluded whatever this says."""
    temperature: float = Field(default=0.05, gt=0)
    """Softmax temperature of training logits (q · v / temperature)."""
    scoring_head: bool = False
    """Add a learned head over (query, item) pairs to the dot product of re-ranked candidates."""
    head_hidden: PositiveInt = 64
    """Hidden width of the scoring head."""
    head_tasks: Names = Field(default=("engagement",), min_length=1)
    """Task outputs of the head; combined into one value with ``head_task_weights``."""
    head_task_weights: Weights = (1.0,)
    """One weight per task of ``head_tasks``."""
    head_candidates: PositiveInt = 200
    """Candidates the head re-scores (at least K + history length)."""
    index: IVFConfig = Field(default_factory=IVFConfig)
    """``[model.index]``: the in-model IVF index."""

    @field_validator("head_task_weights")
    @classmethod
    def _one_weight_per_task(cls, value: tuple[float, ...], info: ValidationInfo) -> Any:
        tasks = info.data.get("head_tasks")
        if tasks is not None and len(value) != len(tasks):
            raise ValueError(f"one per task of head_tasks ({len(tasks)}), got {len(value)}")
        return value


class ModelConfig(ModelSettings):
    """Shapes of the towers and tables, the index settings and the scoring stage: the settings
    and what the data and the publish decided."""

    num_items: Annotated[PositiveInt, FromData]
    """Rows of the item table (item ids are ``0 .. num_items - 1``)."""
    user_features: Annotated[dict[str, PositiveInt], FromData]
    """Categorical user feature -> vocabulary size (one id per user); for a feature named in
    ``hashed_user_features``: the rows of its working table in training."""
    dense_dim: Annotated[int, Field(ge=0), FromData]
    """Dense user features per user."""
    item_attributes: Annotated[dict[str, list[Value]], FromData]
    """Item attribute -> values; they feed the item tower and the eligibility filter."""
    numeric_attributes: Names = ()
    """Item attributes that hold one number an item (a price, a duration): filters compare them
    (``price < 20``, ``length between 60 and 90``), exactly; they do not feed the item tower.
    :meth:`RetrievalModel.build_index` takes their numbers ``[N]`` with the item attributes."""
    hashed_user_features: Names = ()
    """User features whose values are raw 64-bit ids (any int64; -1: none), not codes: their
    tables are keyed by id (``sharded_tables/hashed_training.py`` trains them over a working
    table and the embedding servers)."""
    table_plan: dict[str, Any] | None = None
    """Tiered, quantized tables: a :class:`sharded_tables.planner.PlacementPlan` as a dict.
    ``None``: plain float tables in the process (what training uses)."""

    @field_validator("hashed_user_features")
    @classmethod
    def _known_features(cls, value: tuple[str, ...], info: ValidationInfo) -> Any:
        known = info.data.get("user_features") or {}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"{unknown} are not user features (known: {sorted(known)})")
        return value

    @field_validator("table_plan")
    @classmethod
    def _a_plan(cls, value: dict[str, Any] | None) -> Any:
        if value is not None:
            from sharded_tables.planner import PlacementPlan

            PlacementPlan.from_dict(value)  # raises naming the bad field
        return value

    def validate(self) -> None:  # type: ignore[override]  # pydantic's is a deprecated v1 name
        """Checks the fields as they are now (code may change a built config, e.g. narrow its
        user features): :class:`~common.config.ConfigError` naming the first bad one."""
        type(self).from_dict(dict(self))

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values."""
        return self.model_dump(mode="json")

    def save(self, path: Path) -> None:
        """``config.json``: the fields and the folder's format."""
        path.write_text(json.dumps({"format": MODEL_FORMAT, **self.to_dict()}, indent=2))
