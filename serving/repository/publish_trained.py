"""publish_trained: a trained model -> a new version in a model repository, by ``[publish]``.

The policy of train.toml's ``[publish]`` table (``retrieval.training.config.PublishConfig``):

1. the served tables stay the trained float tables when ``table_dtype`` is fp32, no user feature
   is hashed and no embedding server is asked for; otherwise the placement planner tiers them
   (``retrieval.tiering.tier_model``): quantized to ``table_dtype``, ``host_budget`` of rows in
   the serving process and the rest on ``embedding_servers`` of ``server_budget`` each (hashed
   tables by key, since their rows follow the ids they learned);
2. the catalog is split into ``shards`` document shards when > 0 (for ``serve router``);
3. the version is written atomically with its embedding servers' folders
   (``ModelRepository.publish``), keeping the newest ``keep``: a running server swaps to it.

Example::

    published = publish_trained(model, PublishConfig(model_repo=Path("repo"), name="demo"))
    print(published.describe())  # "published demo v3 (int8 tables) to repo/demo/3"

It lives beside :class:`~serving.repository.repository.ModelRepository` because it needs both
the model's tiering (``retrieval/``) and the repository: ``retrieval/`` may not import
``serving/`` (the package layers in pyproject.toml), and a CLI should hold no policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from retrieval.model import RetrievalModel
from retrieval.tiering import tier_model
from retrieval.training.config import PublishConfig
from serving.repository.repository import ModelRepository
from sharded_tables.export import RemoteRows
from sharded_tables.placement import PlanError
from sharded_tables.specs import DType


@dataclass(frozen=True)
class Published:
    """The version ``publish_trained`` wrote."""

    name: str
    version: int
    path: Path
    """The version's folder."""
    dtype: DType
    """The served tables' dtype."""
    remote_tables: list[str] = field(default_factory=list)
    """Tables the plan put on embedding servers, sorted (``[]``: all in the serving process)."""
    embedding_servers: int = 0
    shards: int | None = None
    """Document shards of the catalog (None: one index)."""

    def describe(self) -> str:
        """One line for people: what was published, how, and where."""
        where = ""
        if self.remote_tables:
            where = f", tables {self.remote_tables} on {self.embedding_servers} embedding servers"
        split = f", {self.shards} document shards" if self.shards else ""
        return (
            f"published {self.name} v{self.version} ({self.dtype.value} tables{where}{split}) "
            f"to {self.path}"
        )


def needs_tiering(model: RetrievalModel, spec: PublishConfig) -> bool:
    """Whether the served tables differ from the trained ones: quantized, hashed (their rows
    are keyed by the ids they learned) or partly on embedding servers."""
    hashed = bool(model.config.hashed_user_features)
    return DType(spec.table_dtype) is not DType.FP32 or hashed or spec.embedding_servers > 0


def served_tables(
    model: RetrievalModel, spec: PublishConfig
) -> tuple[RetrievalModel, RemoteRows | None]:
    """``model`` as it will be served (tiered when :func:`needs_tiering`) and the packed rows of
    the tables its plan puts on embedding servers (None: none). Raises ``ValueError`` naming
    ``publish.host_budget / publish.server_budget`` when the tables do not fit the budgets."""
    if not needs_tiering(model, spec):
        return model, None
    try:
        served, rows = tier_model(model, spec.budgets(), dtype=DType(spec.table_dtype))
    except PlanError as e:
        raise ValueError(f"publish.host_budget / publish.server_budget: {e}") from None
    return served, rows or None


def publish_trained(model: RetrievalModel, spec: PublishConfig) -> Published:
    """Publishes the trained ``model`` by ``spec``'s policy (the module docstring) as the next
    version of ``spec.name`` in ``spec.model_repo``; -> what was written."""
    served, remote_rows = served_tables(model, spec)
    shards = spec.shards or None
    repo = ModelRepository(spec.model_repo)
    version = repo.publish(
        spec.name, served, shards=shards, keep=spec.keep, remote_rows=remote_rows
    )
    return Published(
        spec.name,
        version,
        repo.version_dir(spec.name, version),
        DType(spec.table_dtype),
        sorted(remote_rows or {}),
        spec.embedding_servers,
        shards,
    )
