"""train.toml (``retrieval/training/config.py``): unknown keys and bad values refused naming the
file and ``table.key``, a full file round-trips, the sections mirror the dataclasses they build."""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import retrieval.training.config as config_module
from common.config import ConfigError
from retrieval.config import ModelConfig, ModelSettings
from retrieval.data import SyntheticConfig
from retrieval.index.codes import CODE_KINDS
from retrieval.index.ivf import EXACT_DTYPES, METRICS, PROBES, IVFConfig
from retrieval.training.config import (
    DataConfig,
    ModelSection,
    PublishConfig,
    RunConfig,
    TrainConfig,
)
from sharded_tables.specs import DType
from sharded_tables.trainable import OPTIMIZERS

FULL = """
[data]
source = "synthetic"
num_users = 300
num_items = 500
num_topics = 8
topics_per_user = [2, 4]
interactions_per_user = 12.5
interactions_spread = 0.3
min_interactions = 3
zipf_exponent = 0.9
explore = 0.2
num_categories = 6
category_follows_topic = 0.5
available_fraction = 1.0
seed = 7

[model]
user_features = ["region"]
embedding_dim = 16
hidden = [32, 16]
out_dim = 8
history_len = 10
exclude_history = false
temperature = 0.1
scoring_head = true
head_hidden = 16
head_tasks = ["click", "watch"]
head_task_weights = [0.5, 0.5]
head_candidates = 50

[model.index]
nlist = 16
nprobe = 4
codes = "fp8"
rerank = 20
exact_copy = "float32"
kmeans_iters = 5
kmeans_max_points_per_centroid = 64
seed = 3
exact_cost = 1.5
filter_nprobe_exponent = 0.25
target_recall = 0.0
tune_k = 10

[train]
epochs = 2
batch_size = 128
lr = 0.01
weight_decay = 0.001
table_optimizer = "adam"
table_lr = 0.1
random_negatives = 64
micro_batches = 2
seed = 1
progress = false
checkpoint_dir = "ckpt"
checkpoint_every = 10
max_steps = 100

[evaluate]
k = 20
users = 0
validation = 0.2
patience = 3

[publish]
model_repo = "repo"
name = "demo-2"
shards = 2
table_dtype = "fp16"
keep = 1
"""


def load(tmp_path: Path, text: str) -> RunConfig:
    path = tmp_path / "train.toml"
    path.write_text(text)
    return RunConfig.from_toml(path)


def refused(tmp_path: Path, text: str, field: str) -> str:
    """Loads ``text``; asserts the error names the file and then ``field``; -> the message."""
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'train.toml'}: {field}: "), message
    return message


def test_a_full_file_round_trips(tmp_path):
    cfg = load(tmp_path, FULL)
    assert RunConfig.from_dict(cfg.model_dump(exclude_unset=True)) == cfg  # the keys given
    for table, values in tomllib.loads(FULL).items():  # every key set, none to its default
        section = getattr(cfg, table)
        for key, value in values.items():
            if key in ("index", "source"):  # a table; the default source
                continue
            got = getattr(section, key)
            if isinstance(got, Path | tuple):  # the model's settings hold tuples
                value = type(got)(value)
            assert got == value, (table, key)
            assert got != type(section).model_fields[key].default, (table, key)
    assert cfg.model.index == IVFConfig.from_dict(tomllib.loads(FULL)["model"]["index"])
    assert cfg.model.index.resolved(500).nlist == 16


def test_an_empty_file_is_the_defaults(tmp_path):
    cfg = load(tmp_path, "")
    assert cfg == RunConfig() and cfg.publish is None
    assert cfg.train.batch_size == 512 and cfg.evaluate.users == 2000


def test_the_example_in_the_module_docstring_loads(tmp_path):
    doc = config_module.__doc__ or ""
    example = doc.split("::\n", 1)[1].split("\nA bad value", 1)[0]
    cfg = load(tmp_path, "\n".join(line.removeprefix("    ") for line in example.splitlines()))
    assert cfg.publish is not None and cfg.publish.name == "demo"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[nope]\n", "nope"),
        ("[data]\nnope = 1\n", "data.nope"),
        ("[model]\nnum_items = 10\n", "model.num_items"),  # derived from the data
        ("[model]\ntable_plan = {}\n", "model.table_plan"),  # training takes float tables
        ("[model.index]\nnlists = 10\n", "model.index.nlists"),
        ("[train]\nlearning_rate = 0.1\n", "train.learning_rate"),
        ("[evaluate]\nrecall = 1\n", "evaluate.recall"),
        ("[publish]\nmodel_repo = 'r'\nname = 'n'\nversion = 1\n", "publish.version"),
    ],
)
def test_an_unknown_key_is_refused_naming_it(tmp_path, text, field):
    assert "unknown key (known: [" in refused(tmp_path, text, field)


@pytest.mark.parametrize(
    ("text", "field", "why"),
    [
        ("data = 3\n", "data", "expected table"),
        ("[data]\nsource = 'csv'\n", "data.source", "expected 'synthetic', 'movielens' or 'parquet'"),
        ("[data]\nsource = 'movielens'\nnum_users = 5\n", "data.num_users", "movielens"),
        ("[data]\ndata_dir = 'x'\n", "data.data_dir", "only with source = 'movielens'"),
        ("[data]\nnum_users = 0\n", "data.num_users", "must be >= 1, got 0"),
        ("[data]\nnum_users = '5'\n", "data.num_users", "expected int"),
        ("[data]\nexplore = 1.5\n", "data.explore", "must be in [0, 1], got 1.5"),
        ("[data]\ntopics_per_user = [3, 2]\n", "data.topics_per_user", "lo <= hi"),
        ("[data]\ntopics_per_user = [1]\n", "data.topics_per_user", "at least 2"),
        ("[model]\nhidden = [0]\n", "model.hidden[0]", "must be >= 1"),
        ("[model]\nuser_features = 'region'\n", "model.user_features", "expected list"),
        ("[model]\ntemperature = 0.0\n", "model.temperature", "must be > 0"),
        ("[model]\nhead_task_weights = [1.0, 2.0]\n", "model.head_task_weights", "one per task"),
        ("[model.index]\ncodes = 'int4'\n", "model.index.codes", "expected 'int8' or 'fp8'"),
        ("[model.index]\ntarget_recall = nan\n", "model.index.target_recall", "finite"),
        ("[train]\nbatch_size = 0\n", "train.batch_size", "must be >= 1, got 0"),
        ("[train]\nepochs = true\n", "train.epochs", "expected int, got True"),
        ("[train]\nlr = 0\n", "train.lr", "must be > 0"),
        ("[train]\ntable_optimizer = 'lamb'\n", "train.table_optimizer", "got 'lamb'"),
        ("[train]\nbatch_size = 128\nmicro_batches = 3\n", "train.micro_batches",
         "must divide batch_size (128), got 3"),
        ("[train]\ncheckpoint_every = 5\n", "train.checkpoint_every", "needs train.checkpoint_dir"),
        ("[train]\nseed = -1\n", "train.seed", "must be >= 0"),
        ("[train.sharding]\ntypes = ['data_parallel']\n", "train.sharding.types[0]",
         "got 'data_parallel'"),
        ("[train.sharding]\ntypes = []\n", "train.sharding.types", "at least 1"),
        ("[train.sharding]\nddr_budget = 0\n", "train.sharding.ddr_budget", "must be >= 1"),
        ("[train.sharding]\nhbm_budget = 1.5\n", "train.sharding.hbm_budget", "expected int"),
        ("[train.sharding]\ncolumn_shard_dim = 6\n", "train.sharding.column_shard_dim",
         "multiple of 4"),
        ("[evaluate]\nk = 0\n", "evaluate.k", "must be >= 1, got 0"),
        ("[evaluate]\nusers = -1\n", "evaluate.users", "must be >= 0, got -1"),
        ("[evaluate]\nvalidation = 1.0\n", "evaluate.validation", "must be < 1.0, got 1.0"),
        ("[evaluate]\nvalidation = -0.1\n", "evaluate.validation", "must be >= 0"),
        ("[evaluate]\npatience = -1\n", "evaluate.patience", "must be >= 0, got -1"),
        ("[publish]\nname = 'demo'\n", "publish.model_repo", "required"),
        ("[publish]\nmodel_repo = 'r'\nname = '../x'\n", "publish.name", "must match"),
        ("[publish]\nmodel_repo = 'r'\nname = 'n'\ntable_dtype = 'bf16'\n", "publish.table_dtype",
         "got 'bf16'"),
        ("[publish]\nmodel_repo = 'r'\nname = 'n'\nshards = -1\n", "publish.shards", ">= 0"),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_naming_table_and_key(tmp_path, text, field, why):
    assert why in refused(tmp_path, text, field)


def test_a_file_that_is_no_toml_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"^--config: .* is not valid TOML"):
        load(tmp_path, "[train\n")
    with pytest.raises(ConfigError, match=r"^--config: cannot read"):
        RunConfig.from_toml(tmp_path / "missing.toml")


# ---- any bad value of a bounded field is refused naming it -------------------------------------
def bounded_fields() -> list[tuple[str, str, Any]]:
    """(table, key, bounds) of every field with a numeric bound."""
    found = []
    tables = {"data": DataConfig, "model": ModelSection, "model.index": IVFConfig,
              "train": TrainConfig, "evaluate": config_module.EvaluateConfig,
              "publish": PublishConfig}  # fmt: skip
    for table, cls in tables.items():
        for key, info in cls.model_fields.items():
            bounds = {k: getattr(m, k) for m in info.metadata for k in ("ge", "gt", "le", "lt")
                      if getattr(m, k, None) is not None}  # fmt: skip
            if bounds and info.annotation in (int, float, int | None):
                found.append((table, key, bounds))
    return found


BOUNDED = bounded_fields()


@st.composite
def bad_values(draw: st.DrawFn) -> tuple[str, str, object]:
    table, key, bounds = draw(st.sampled_from(BOUNDED))
    low = bounds.get("ge", bounds.get("gt"))
    high = bounds.get("le", bounds.get("lt"))
    options = [st.sampled_from(["1", True, [1], math.nan, math.inf])]
    if low is not None:
        top = low if "gt" in bounds else low - 1
        options.append(st.integers(-(2**63), math.floor(top)))
    if high is not None:
        options.append(st.floats(min_value=high, exclude_min="le" in bounds, allow_infinity=False))
    return table, key, draw(st.one_of(options))


def toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


@settings(max_examples=150, deadline=None, database=None)
@given(bad_values())
def test_any_bad_value_of_a_bounded_field_is_refused_naming_it(tmp_path_factory, bad):
    table, key, value = bad
    extra = "model_repo = 'r'\nname = 'n'\n" if table == "publish" else ""
    path = tmp_path_factory.mktemp("cfg") / "train.toml"
    path.write_text(f"[{table}]\n{extra}{key} = {toml(value)}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {re.escape(table)}\.{key}: "):
        RunConfig.from_toml(path)


# ---- the sections mirror the dataclasses they build, or are the model's own classes -------------
def defaults(cls: type) -> dict[str, Any]:
    return {
        f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        for f in fields(cls)
        if f.default is not MISSING or f.default_factory is not MISSING
    }


def as_dataclass_values(section: Any, skip: set[str]) -> dict[str, Any]:
    out = {}
    for key, value in section.model_dump(exclude=skip).items():
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def test_data_mirrors_synthetic_config():
    section = DataConfig()
    assert as_dataclass_values(section, {"source", "data_dir", "path"}) == defaults(SyntheticConfig)
    assert section.synthetic() == SyntheticConfig()
    assert DataConfig(num_users=5, topics_per_user=[2, 2]).synthetic() == SyntheticConfig(
        num_users=5, topics_per_user=(2, 2)
    )


def test_model_section_is_the_model_settings():
    """``[model]`` is the model's own settings class (one declaration, one default per field),
    plus the two choices that need the data; ``[model.index]`` is the index's config."""
    assert issubclass(ModelSection, ModelSettings) and issubclass(ModelConfig, ModelSettings)
    assert set(ModelSection.model_fields) == set(ModelSettings.model_fields) | {
        "user_features", "hashed_user_id"
    }  # fmt: skip
    assert ModelSection.model_fields["index"].annotation is IVFConfig
    settings = ModelSection(hidden=[8], index={"nlist": 4}).settings()
    assert settings["hidden"] == (8,) and settings["index"] == IVFConfig(nlist=4)
    built = ModelConfig(num_items=9, user_features={}, dense_dim=0, item_attributes={}, **settings)
    assert built.index is settings["index"]


def test_index_defaults_follow_the_catalog():
    """Left unset, nlist, nprobe and the target recall are what ``recserve train`` and the demo
    always built with: about sqrt(N) lists, nlist / 8 to start, nprobe tuned for 0.97; an nprobe
    given stands (no tuning) unless a target is given too."""
    built = IVFConfig().resolved(num_items=10_000)
    assert (built.nlist, built.nprobe, built.target_recall) == (100, 12, 0.97)
    untouched = {k: v for k, v in IVFConfig().model_dump().items() if k not in
                 ("nlist", "nprobe", "target_recall", "exact_copy")}  # fmt: skip
    assert {k: getattr(built, k) for k in untouched} == untouched
    assert built.exact_copy == "none" and IVFConfig(rerank=5).resolved(10).exact_copy == "float16"
    assert IVFConfig(nlist=64).resolved(10_000).nprobe == 8
    assert IVFConfig(nprobe=4).resolved(10_000).target_recall == 0.0
    assert IVFConfig(nprobe=4, target_recall=0.9).resolved(10_000).target_recall == 0.9
    assert built.resolved(5) is built


def test_choices_are_the_consumers():
    hints = {
        "codes": (IVFConfig, set(CODE_KINDS)),
        "exact_copy": (IVFConfig, {*EXACT_DTYPES, "auto"}),
        "metric": (IVFConfig, set(METRICS)),
        "probe": (IVFConfig, set(PROBES)),
        "table_optimizer": (TrainConfig, {*OPTIMIZERS, "adam"}),
        "table_dtype": (PublishConfig, {d.value for d in DType}),
    }
    for key, (cls, expected) in hints.items():
        assert set(get_args(cls.model_fields[key].annotation)) == expected, key
    name = PublishConfig.model_fields["name"].metadata
    assert any(getattr(m, "pattern", None) for m in name)


def test_a_train_config_built_in_code_is_checked():
    with pytest.raises(ConfigError, match=r"^batch_size: must be >= 1, got 0"):
        TrainConfig(batch_size=0)
    cfg = TrainConfig(batch_size=64, lr=1)  # an int where a float is wanted is fine
    assert cfg.updated(table_optimizer="adam").table_optimizer == "adam"
