"""publish_trained: ``[publish]``'s policy (when to tier, which budgets, shards) as one call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from retrieval.training.config import PublishConfig
from serving.repository.publish_trained import needs_tiering, publish_trained
from serving.repository.repository import ModelRepository


def spec(root: Path, **fields: object) -> PublishConfig:
    return PublishConfig(model_repo=root, name="demo", **fields)


def test_float_tables_in_the_process_are_published_as_trained(tiny, tmp_path):
    cfg = spec(tmp_path, table_dtype="fp32")
    assert not needs_tiering(tiny.model, cfg)
    published = publish_trained(tiny.model, cfg)
    assert (published.version, published.remote_tables, published.shards) == (1, [], None)
    assert published.describe() == f"published demo v1 (fp32 tables) to {tmp_path / 'demo' / '1'}"
    loaded = ModelRepository(tmp_path).load("demo", 1).model
    for name, rows in tiny.model.tables.float_weights().items():
        assert torch.equal(loaded.tables.float_weights()[name], rows)


def test_quantized_tables_are_tiered_and_the_catalog_split_into_shards(tiny, tmp_path):
    cfg = spec(tmp_path, table_dtype="int8", shards=2)
    assert needs_tiering(tiny.model, cfg)
    published = publish_trained(tiny.model, cfg)
    assert published.shards == 2 and published.dtype.value == "int8"
    assert "int8 tables, 2 document shards" in published.describe()
    repo = ModelRepository(tmp_path)
    assert repo.load_shard("demo", 1, 1)[1].num_shards == 2
    assert repo.load("demo", 1).model.config.table_plan is not None  # tiered by the planner


def test_tables_over_the_host_budget_go_to_embedding_servers(tiny, tmp_path):
    cfg = spec(tmp_path, table_dtype="int8", host_budget="1KiB", embedding_servers=2)
    published = publish_trained(tiny.model, cfg)
    assert published.remote_tables  # what does not fit in 1 KiB
    assert "on 2 embedding servers" in published.describe()


def test_tables_that_fit_no_budget_are_refused_naming_the_budgets(tiny, tmp_path):
    cfg = spec(tmp_path, table_dtype="int8", host_budget="1KiB")
    with pytest.raises(ValueError, match=r"^publish.host_budget / publish.server_budget: "):
        publish_trained(tiny.model, cfg)
    assert ModelRepository(tmp_path).versions("demo") == []
