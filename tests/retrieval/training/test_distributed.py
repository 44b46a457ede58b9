"""`recserve train` as 2 processes (torchrun, gloo, TorchRec's DMP over the tables) equals 1
process with 2 micro-batches; bad configs are refused at start naming the field, the sharding
ones under torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.train_runs import train, train_cmd, weights, write_config

pytestmark = pytest.mark.multiproc


@pytest.mark.slow
def test_two_processes_train_the_same_model_as_one(tmp_path):
    one = weights(train(tmp_path, "one", nproc=1, micro=2))
    two = weights(train(tmp_path, "two", nproc=2))
    assert any(k.startswith("tables.") for k in one)
    assert one.keys() == two.keys()
    for k in one:
        # the same math; only the order of float sums differs (all_reduce of the dense
        # gradients, the two slices' table gradients summed per row): ~1e-7 per step
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize(
    ("table", "line", "field"),
    [
        ("model", 'user_features = ["age_bucket", "shoe_size"]', "model.user_features"),
        ("model", "out_dimension = 8", "model.out_dimension"),
        ("train", "batch_size = 0", "train.batch_size"),
        ("data", 'source = "kaggle"', "data.source"),
        ("evaluate", "k = 100", "evaluate.k"),  # more than the 60 items: known once data loads
    ],
)
def test_a_bad_config_is_refused_at_start_naming_the_field(tmp_path, table, line, field):
    tables: dict[str, list[str]] = {"data": ["num_users = 50", "num_items = 60"], table: []}
    tables[table].append(line)
    cfg = tmp_path / "bad.toml"
    cfg.write_text("".join(f"[{t}]\n" + "\n".join(lines) + "\n" for t, lines in tables.items()))
    out = subprocess.run(
        [sys.executable, "-m", "recserve", "train", "--config", str(cfg), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert field in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "field", "why"),
    [
        ('types = ["row_wise"]', "train.sharding.types", "does not shard ['row_wise'] on the cpu"),
        ("ddr_budget = 20000", "train.sharding.ddr_budget", "cannot place the tables"),
    ],
)
def test_a_sharding_torchrec_refuses_stops_the_job_before_any_step(tmp_path, sharding, field, why):
    cfg = write_config(tmp_path, "bad", train=f"[train.sharding]\n{sharding}")
    out = subprocess.run(
        train_cmd(cfg, tmp_path / "bad", 2), capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert f"train: {field}: " in out.stderr and why in out.stderr
    assert not (Path(tmp_path / "bad") / "checkpoints").exists()  # no step, no checkpoint
