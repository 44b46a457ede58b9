"""TorchRec's planner over our tables (pure: no process group): the plan [train.sharding] asks
for, and refusals that name the field (a type TorchRec does not offer on the CPU, a budget the
tables cannot fit in, a table optimizer that is not fused)."""

from __future__ import annotations

from typing import Any

import pytest

from retrieval.training.config import ShardingConfig
from retrieval.training.sharding import make_sharder, plan_sharding, shard_dim
from sharded_tables.collection import TableConfig

TABLES = [
    TableConfig("item", 5000, 32, features=("history", "item_id")),
    TableConfig("user_country", 40, 32),
    TableConfig("attr_category", 12, 32, features=("item_category",)),
]


def shards(plan: Any) -> dict[str, list[tuple[int, list[int], list[int]]]]:
    """``{table: [(rank, offsets, sizes)]}`` of a ShardingPlan of one root EBC."""
    return {
        name: [
            (s.placement.rank(), list(s.shard_offsets), list(s.shard_sizes))
            for s in ps.sharding_spec.shards
        ]
        for name, ps in plan.plan[""].items()
    }


def test_table_wise_puts_each_table_whole_on_one_rank_and_uses_both():
    plan = plan_sharding(TABLES, ShardingConfig(), 2, make_sharder("rowwise_adagrad", 0.05))
    placed = shards(plan)
    assert set(placed) == {t.name for t in TABLES}
    for t in TABLES:
        ((_rank, offsets, sizes),) = placed[t.name]
        assert offsets == [0, 0] and sizes == [t.num_embeddings, t.dim]
    assert {s[0][0] for s in placed.values()} == {0, 1}


def test_column_wise_splits_every_table_over_both_ranks():
    cfg = ShardingConfig(types=["column_wise"])
    plan = plan_sharding(TABLES, cfg, 2, make_sharder("rowwise_adagrad", 0.05))
    for t in TABLES:
        parts = sorted(shards(plan)[t.name], key=lambda s: s[1][1])
        assert [s[1][1] for s in parts] == [0, t.dim // 2]
        assert all(s[2] == [t.num_embeddings, t.dim // 2] for s in parts)
        assert {s[0] for s in parts} == {0, 1}


def test_the_column_shard_width_follows_the_config_and_the_world():
    t = TABLES[0]
    assert shard_dim(t, ShardingConfig(), 2) == 16
    assert shard_dim(t, ShardingConfig(), 3) == 12  # 32 / 3 rounded up to fbgemm's step of 4
    assert shard_dim(t, ShardingConfig(column_shard_dim=8), 2) == 8
    assert shard_dim(t, ShardingConfig(column_shard_dim=64), 2) == 32


@pytest.mark.parametrize("kind", ["row_wise", "table_row_wise"])
def test_a_type_torchrec_does_not_offer_on_the_cpu_is_refused_naming_the_field(kind):
    cfg = ShardingConfig(types=["table_wise", kind])
    with pytest.raises(ValueError, match=rf"^train\.sharding\.types: .*{kind}.*cpu backend"):
        plan_sharding(TABLES, cfg, 2, make_sharder("rowwise_adagrad", 0.05))


def test_a_budget_the_tables_cannot_fit_is_refused_naming_the_field():
    rows = 5000 * 32 * 4  # the item table alone
    sharder = make_sharder("rowwise_adagrad", 0.05)
    with pytest.raises(ValueError, match=r"^train\.sharding\.ddr_budget: .*'item' 640000 bytes"):
        plan_sharding(TABLES, ShardingConfig(ddr_budget=rows // 2), 2, sharder)
    # room for the rows, the optimizer state and TorchRec's reserve: it plans
    plan_sharding(TABLES, ShardingConfig(ddr_budget=64 * rows), 2, sharder)


def test_tables_in_adam_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^train\.table_optimizer: .*fused"):
        make_sharder("adam", 0.05)
