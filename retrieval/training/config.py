"""``recserve train``'s configuration: ``train.toml`` as one typed :class:`RunConfig`, one model
per table, every constraint declared once on its field (``common/config.py``).

Example ``train.toml`` (every table optional, every key but ``[publish]``'s first two)::

    [data]
    source = "synthetic"        # or "movielens" (data_dir = "data/ml-100k"), or "parquet"
                                # (path = "data/shop": a `recserve data import` folder)
    num_users = 2000            # synthetic only
    num_items = 5000

    [model]
    embedding_dim = 32
    out_dim = 64
    user_features = ["age_bucket", "country"]   # a subset of the data's user features

    [model.index]               # the in-model IVF index
    codes = "int8"

    [train]
    epochs = 5
    batch_size = 512
    table_optimizer = "rowwise_adagrad"

    [train.sharding]            # torchrun only: TorchRec's planner splits the tables
    types = ["table_wise"]      # or column_wise, table_column_wise (CPU)
    ddr_budget = 8_000_000_000  # bytes per rank

    [evaluate]
    k = 100                     # at most the catalog's size
    users = 2000                # held-out users evaluated (0: all)
    validation = 0.1            # share of training held out for early stopping (0: off)
    patience = 2                # epochs without improvement before stopping

    [publish]                   # publish into a model repository
    model_repo = "runs/train/model_repo"
    name = "demo"
    shards = 0                  # > 0: document shards
    table_dtype = "int8"        # the served tables' dtype

A bad value is refused before any work, naming the file and the field
(``train.toml: train.batch_size: must be >= 1, got 0``).

``[model]`` *is* the model's own settings (:class:`retrieval.config.ModelSettings`, with
``[model.index]`` the index's :class:`retrieval.index.config.IVFConfig`): one declaration, one
set of defaults, for the file and for the code. ``[data]`` builds the generator's dataclass
(:class:`retrieval.data.SyntheticConfig`; ``tests/retrieval/training/test_train_config.py``
holds names and defaults equal). :class:`TrainConfig` is the trainer's own. Importing this
module loads no torch (those modules are imported inside the builders).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from common.config import Config, PathValue
from retrieval.config import ModelSettings

if TYPE_CHECKING:
    from retrieval.data import SyntheticConfig

PositiveInt = Annotated[int, Field(ge=1)]
Share = Annotated[float, Field(ge=0, le=1)]
"""A probability or a fraction: 0 to 1."""
Seed = Annotated[int, Field(ge=0)]
"""A random seed (numpy's seed sequences take no negative number)."""


# ---- [data] ------------------------------------------------------------------------------------
class DataConfig(Config):
    """``[data]``: where the interactions come from. ``synthetic`` takes the generator's keys
    (:class:`retrieval.data.SyntheticConfig`), ``movielens`` only ``data_dir``, ``parquet`` only
    ``path``."""

    source: Literal["synthetic", "movielens", "parquet"] = "synthetic"
    """The generated data set, MovieLens 100k from ``data_dir``, or a data set folder
    (``recserve data import``) at ``path``."""
    data_dir: PathValue = Path("data/ml-100k")
    """movielens: the MovieLens 100k folder (``recserve data movielens`` fetches it)."""
    path: PathValue | None = Field(default=None, validate_default=True)
    """parquet: the data set folder that ``recserve data import`` wrote (checked at start)."""
    num_users: PositiveInt = 2000
    """synthetic: users."""
    num_items: PositiveInt = 5000
    """synthetic: items of the catalog."""
    num_topics: PositiveInt = 20
    """synthetic: latent interest topics."""
    topics_per_user: list[PositiveInt] = Field(default=[1, 3], min_length=2, max_length=2)
    """synthetic: ``[lo, hi]``, the inclusive range of each user's number of interest topics
    (``1 <= lo <= hi <= num_topics``)."""
    interactions_per_user: float = Field(default=40.0, gt=0)
    """synthetic: mean interactions per user (lognormal, at least ``min_interactions``)."""
    interactions_spread: float = Field(default=0.6, ge=0)
    """synthetic: sigma of the lognormal number of interactions per user."""
    min_interactions: PositiveInt = 5
    """synthetic: fewest interactions of a user."""
    zipf_exponent: float = Field(default=1.1, ge=0)
    """synthetic: item popularity is ``1 / rank ** zipf_exponent``."""
    explore: Share = 0.1
    """synthetic: share of draws from the whole catalog instead of the user's topics."""
    num_categories: PositiveInt = 12
    """synthetic: values of the ``category`` attribute."""
    category_follows_topic: Share = 0.8
    """synthetic: probability that an item's category is its topic's."""
    available_fraction: Share = 0.9
    """synthetic: share of items ``available``."""
    seed: Seed = 0
    """synthetic: seed of the generator (the same seed, the same data)."""

    @field_validator("data_dir")
    @classmethod
    def _only_movielens(cls, value: Path, info: ValidationInfo) -> Path:
        if info.data.get("source") != "movielens":
            raise ValueError("only with source = 'movielens'")
        return value

    @field_validator("path")
    @classmethod
    def _a_data_set_folder(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        source = info.data.get("source")
        if source != "parquet":
            if value is not None:
                raise ValueError("only with source = 'parquet'")
            return value
        if value is None:
            raise ValueError("required with source = 'parquet' (a `recserve data import` folder)")
        from retrieval.data.schema import META_FILE

        if not value.is_dir():
            raise ValueError(f"{value} is not a folder (`recserve data import --out` writes one)")
        if not (value / META_FILE).is_file():
            raise ValueError(
                f"{value} is not a data set folder: no {META_FILE} (`recserve data import` "
                "writes one)"
            )
        return value

    @field_validator(
        "num_users", "num_items", "num_topics", "topics_per_user", "interactions_per_user",
        "interactions_spread", "min_interactions", "zipf_exponent", "explore",
        "num_categories", "category_follows_topic", "available_fraction", "seed",
    )  # fmt: skip
    @classmethod
    def _only_synthetic(cls, value: Any, info: ValidationInfo) -> Any:
        source = info.data.get("source")
        if source != "synthetic":
            known = "data_dir" if source == "movielens" else "path"
            raise ValueError(f"unknown key for source = {source!r} (known: {known})")
        if info.field_name == "topics_per_user":
            lo, hi = value
            top = info.data.get("num_topics", 1)
            if not lo <= hi <= top:
                raise ValueError(f"need 1 <= lo <= hi <= num_topics ({top}), got {value}")
        return value

    def synthetic(self) -> SyntheticConfig:
        """The generator's config (``source = "synthetic"``)."""
        from retrieval.data import SyntheticConfig

        values = self.model_dump(exclude={"source", "data_dir", "path"})
        return SyntheticConfig(**{**values, "topics_per_user": tuple(self.topics_per_user)})


# ---- [model] -----------------------------------------------------------------------------------
class ModelSection(ModelSettings):
    """``[model]``: :class:`retrieval.config.ModelSettings` (the towers, the head and
    ``[model.index]``: :class:`retrieval.index.config.IVFConfig`, the model's own classes) and
    two choices of the training data (the catalog's size, item attributes and dense width come
    from the data; training takes float tables, so no ``table_plan``: ``[publish] table_dtype``
    quantizes the served copy)."""

    user_features: list[str] | None = None
    """Categorical user features the tower reads: a subset of the data's (None: all)."""
    hashed_user_id: int = Field(default=0, ge=0)
    """Working rows of the hashed feature ``raw_id``: the user's own id as a raw int64 (an
    imported log's user ids; a 63-bit hash of the user index for generated and MovieLens data),
    its table trained over this many rows and ``[train.hashed]``'s servers; 0: off."""

    def settings(self) -> dict[str, Any]:
        """The :class:`~retrieval.config.ModelSettings` fields, as :class:`ModelConfig` takes
        them (``index`` the config itself)."""
        return {name: getattr(self, name) for name in ModelSettings.model_fields}


# ---- [train] -----------------------------------------------------------------------------------
ShardingType = Literal[
    "table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise"
]
"""TorchRec's names of the ways a table is split over ranks (``torchrec.distributed.types.
ShardingType``); which of them a backend offers is TorchRec's to say (checked at start)."""


def _table_wise() -> list[ShardingType]:
    return ["table_wise"]


class ShardingConfig(Config):
    """``[train.sharding]``: how TorchRec's planner (``EmbeddingShardingPlanner``) splits the
    tables over the ranks of a torchrun job (``retrieval/training/sharding.py``); one process
    ignores it. A plan that cannot fit, or a type TorchRec does not offer on this backend, is
    refused before any step, naming the field."""

    types: list[ShardingType] = Field(default_factory=_table_wise, min_length=1)
    """Sharding types the planner may choose from for every table. On the CPU (gloo) TorchRec
    offers table_wise, column_wise and table_column_wise; row_wise and table_row_wise need
    CUDA."""
    ddr_budget: PositiveInt | None = None
    """Bytes of host memory per rank for the tables, their optimizer state and TorchRec's
    buffers (where the tables live on the CPU); None: TorchRec's default (128 GiB)."""
    hbm_budget: PositiveInt | None = None
    """Bytes of GPU memory per rank (CUDA tables only; the CPU backend has none); None:
    TorchRec's default (32 GiB)."""
    column_shard_dim: PositiveInt | None = None
    """Width of a column-wise shard (a multiple of 4, fbgemm's kernels); None: the embedding
    width over the number of ranks (TorchRec's own default, 128, would not split our tables)."""

    @field_validator("column_shard_dim")
    @classmethod
    def _a_multiple_of_four(cls, value: int | None) -> int | None:
        if value is not None and value % 4:
            raise ValueError(f"must be a multiple of 4 (fbgemm's kernels), got {value}")
        return value


class HashedConfig(Config):
    """``[train.hashed]``: where hashed tables (``[model] hashed_user_id``) keep the rows their
    working table gives up, with their optimizer state: keyed FP32 tables on embedding servers
    (``recserve serve training-store``), ``sharded_tables/hashed_training.py``."""

    servers: list[str] = Field(default_factory=list)
    """``host:port`` of each embedding server holding the training rows (one or more)."""
    policy: Literal["lru", "lfu", "hybrid"] = "lru"
    """Which id a full working table gives up (``sharded_tables/idmap.py``)."""
    admit_after: PositiveInt = 1
    """Sightings before an id gets a working row (until then it pools as padding)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of each call to the servers (seconds)."""


class TrainConfig(Config):
    """Optimization settings (``[train]``; :class:`retrieval.training.train.Trainer`'s config)."""

    epochs: PositiveInt = 5
    """Passes over the training pairs."""
    batch_size: PositiveInt = 512
    """Positive (user, item) pairs per step (over all ranks under torchrun)."""
    lr: float = Field(default=3e-3, gt=0)
    """Adam's learning rate for the dense parts (towers, head)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Adam's weight decay."""
    table_optimizer: Literal["rowwise_adagrad", "adagrad", "sgd", "adam"] = "rowwise_adagrad"
    """Fused fbgemm optimizer of the tables, or "adam" (tables as dense parameters)."""
    table_lr: float = Field(default=0.05, gt=0)
    """Learning rate of the fused table optimizer."""
    random_negatives: int = Field(default=0, ge=0)
    """Items drawn uniformly per batch as extra negatives (0: in-batch negatives only)."""
    hard_negatives: int = Field(default=0, ge=0)
    """Negatives per batch mined from the model's own index (rebuilt each epoch from the
    second on; ``retrieval/training/hard_negatives.py``); 0: none. One process only. A run
    resumed mid-epoch mines from the index of the weights it resumed with."""
    hard_negative_ranks: tuple[int, int] = (10, 100)
    """``[lo, hi)``: each mined item is at a random rank in this range of its user's result
    (the top ``lo`` are skipped: likely the user's next positives)."""
    task_loss_weight: float = Field(default=1.0, ge=0)
    """With a scoring head: weight of its per-task binary cross-entropy (labels from the task
    names, ``retrieval/training/task_labels.py``) beside the softmax; 0: softmax only."""
    history: Literal["causal", "static"] = "causal"
    """What the user tower reads for a training pair: the items the user consumed before it
    ("causal", what a served request carries) or the user's whole training history with the
    positive hidden ("static"). See ``retrieval/training/histories.py``."""
    micro_batches: PositiveInt = 1
    """Each batch's softmax runs over this many equal slices (what each of that many
    data-parallel ranks sees), so one process reproduces a multi-process run; divides
    ``batch_size``."""
    seed: Seed = 0
    """Seed of the initial weights, batch order and negatives."""
    progress: bool = True
    """Show a progress bar with loss and examples/s."""
    checkpoint_dir: PathValue | None = None
    """Where checkpoints are written (``recserve train``: ``OUT/checkpoints`` when unset): one
    process ``checkpoint.pt``; a torchrun job a ``torch.distributed.checkpoint`` folder per
    checkpoint, named in ``LATEST`` (``retrieval/training/dcp_checkpoint.py``)."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Steps between checkpoints (0: at the end of each epoch only); needs checkpoint_dir."""
    max_steps: PositiveInt | None = None
    """Stop after this many steps in all (a later run resumes from the checkpoint)."""
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    """``[train.sharding]``: the tables' split over the ranks of a torchrun job."""
    hashed: HashedConfig = Field(default_factory=HashedConfig)
    """``[train.hashed]``: the embedding servers of hashed tables."""

    @field_validator("micro_batches")
    @classmethod
    def _divides_the_batch(cls, value: int, info: ValidationInfo) -> int:
        batch = info.data.get("batch_size")
        if batch is not None and batch % value:
            raise ValueError(f"must divide batch_size ({batch}), got {value}")
        return value

    @field_validator("checkpoint_every")
    @classmethod
    def _needs_a_folder(cls, value: int, info: ValidationInfo) -> int:
        if value and info.data.get("checkpoint_dir") is None:
            raise ValueError("needs train.checkpoint_dir")
        return value


# ---- [evaluate] [publish] ----------------------------------------------------------------------
class EvaluateConfig(Config):
    """``[evaluate]``: recall@K and NDCG@K. With ``validation > 0`` the latest share of each
    user's training interactions is held out, evaluated after each epoch, and the best epoch's
    weights are kept (early stopping); the test split is evaluated once, at the end, on the kept
    weights, after the model folder is written."""

    k: PositiveInt = 100
    """K of recall@K and NDCG@K; at most the catalog's size (checked once the data is loaded,
    before training)."""
    users: int = Field(default=2000, ge=0)
    """Held-out users evaluated (the first ones with held-out interactions; 0: all)."""
    validation: float = Field(default=0.1, ge=0, lt=1)
    """Share of each user's training interactions (the latest) held out for validation after
    each epoch (0: no validation, no early stopping: the last epoch is kept)."""
    patience: int = Field(default=2, ge=0)
    """Epochs without a better validation recall@K before training stops (0: never stops
    early; the best epoch is still kept)."""


class PublishConfig(Config):
    """``[publish]``: the trained model as a new version in a model repository
    (``serving/repository``), written atomically: a running server swaps to it."""

    model_repo: PathValue
    """Model repository root."""
    name: str = Field(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
    """Model name: one path component (``[A-Za-z0-9_.-]``, not starting with a dot)."""
    shards: int = Field(default=0, ge=0)
    """> 0: split the catalog into this many document shards (for ``serve router``)."""
    table_dtype: Literal["fp32", "fp16", "fp8", "int8", "int4"] = "int8"
    """The served tables' dtype (``sharded_tables.specs.DType``)."""
    keep: PositiveInt = 3
    """Versions of the model kept in the repository (older ones are removed)."""
    host_budget: str | None = None
    """Bytes of table rows the serving process holds (``64MiB``, ``2GiB``); the planner puts
    the rest on ``embedding_servers`` (hashed tables by key). None: every table in the process."""
    embedding_servers: int = Field(default=0, ge=0)
    """Embedding servers of the version's remote tables (their folders are published with it:
    ``recserve cluster up --embedding-servers N`` serves them)."""
    server_budget: str = "4GiB"
    """Bytes of rows each embedding server holds."""

    @field_validator("host_budget", "server_budget")
    @classmethod
    def _a_size(cls, text: str | None) -> str | None:
        from sharded_tables.placement import parse_bytes

        if text is not None:
            parse_bytes(text)
        return text

    @field_validator("embedding_servers")
    @classmethod
    def _servers_need_a_budget(cls, value: int, info: ValidationInfo) -> int:
        if value and info.data.get("host_budget") is None:
            raise ValueError("needs publish.host_budget (what stays in the serving process)")
        return value

    def budgets(self) -> Any:
        """The planner's :class:`~sharded_tables.placement.Budgets` for the served tables."""
        from sharded_tables.placement import Budgets, parse_bytes

        host = 1 << 40 if self.host_budget is None else parse_bytes(self.host_budget)
        per_server = parse_bytes(self.server_budget) if self.embedding_servers else 0
        return Budgets(
            device=0, host=host, remote_servers=self.embedding_servers,
            remote_per_server=per_server,
        )  # fmt: skip


# ---- the file ----------------------------------------------------------------------------------
class RunConfig(Config):
    """``train.toml``: ``recserve train``'s whole run."""

    data: DataConfig = Field(default_factory=DataConfig)
    """``[data]``: the interactions."""
    model: ModelSection = Field(default_factory=ModelSection)
    """``[model]``: the towers, tables and index."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """``[train]``: the optimization."""
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    """``[evaluate]``: held-out metrics."""
    publish: PublishConfig | None = None
    """``[publish]``: publish the trained model; None: only the model folder is written."""
