"""`recserve train` as 2 processes (torchrun, gloo, TorchRec's DMP over the tables) equals 1
process with 2 micro-batches; bad configs are refused at start naming the field, the sharding
ones under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from recserve.cli import app
from support.train_runs import train, train_cmd, weights, write_config

pytestmark = pytest.mark.multiproc


@pytest.mark.slow
def test_two_processes_train_the_same_model_as_one(tmp_path):
    # one epoch (74 steps) only: the runs' ~1e-7 differences (the order of float sums) can put a
    # pre-activation of the user tower's ReLU on either side of 0. On an AMD EPYC (AVX-512) host
    # that happens in epoch 2, step 36: one example's hidden unit is -6e-8 in one run and +4e-8
    # in the other, the first sign flip in 110 steps of 128 x 32 pre-activations. Its gradient
    # passes in one run and not in the other (mlp.0's gradients differ by ~1/batch, mlp.2's by
    # 1e-7), the weights are ~1e-3 apart after that step, and training amplifies it to ~1e-2 by
    # the epoch's end. Inherent in comparing two float orders through a ReLU, not a difference
    # in the math (with the towers' ReLU swapped for a smooth GELU, two epochs agree to ~2e-6);
    # whether a run meets such a near-zero is luck of the host's bits (an Intel host passed two
    # epochs, as does batch 200 here)
    one = weights(train(tmp_path, "one", nproc=1, micro=2, epochs=1))
    two = weights(train(tmp_path, "two", nproc=2, epochs=1))  # 2 ranks, table-wise
    assert any(k.startswith("tables.") for k in one)
    assert one.keys() == two.keys()
    for k in one:
        # the same math; only the order of float sums differs (all_reduce of the dense
        # gradients, the two slices' table gradients summed per row): ~1e-7 per step
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=1e-4, msg=k)


def bad_config(folder: Path, table: str, line: str) -> Path:
    """A 50-user, 60-item run config with ``line`` added to ``[table]``."""
    tables: dict[str, list[str]] = {"data": ["num_users = 50", "num_items = 60"], table: []}
    tables[table].append(line)
    cfg = folder / "bad.toml"
    cfg.write_text("".join(f"[{t}]\n" + "\n".join(lines) + "\n" for t, lines in tables.items()))
    return cfg


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
    # the command in this process (typer's runner); the next test runs it as a process
    cfg = bad_config(tmp_path, table, line)
    res = CliRunner().invoke(app, ["train", "--config", str(cfg), "--out", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert field in res.stderr


def test_a_bad_config_exits_2_from_the_command_line(tmp_path):
    cfg = bad_config(tmp_path, "train", "batch_size = 0")
    out = subprocess.run(
        [sys.executable, "-m", "recserve", "train", "--config", str(cfg), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "train.batch_size" in out.stderr


@pytest.mark.slow
def test_a_sharding_torchrec_refuses_stops_the_job_before_any_step(tmp_path):
    """One refusal under torchrun (the others are checked in process: test_sharding.py)."""
    field, why = "train.sharding.ddr_budget", "cannot place the tables"
    cfg = write_config(tmp_path, "bad", train="[train.sharding]\nddr_budget = 20000")
    out = subprocess.run(
        train_cmd(cfg, tmp_path / "bad", 2), capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert f"train: {field}: " in out.stderr and why in out.stderr
    assert not (Path(tmp_path / "bad") / "checkpoints").exists()  # no step, no checkpoint


@pytest.mark.slow
def test_two_processes_train_hashed_ids_like_one(hashed_two_ranks, tmp_path):
    """A hashed raw-id feature (a working table of 128 rows for 400 users) under TorchRec's DMP:
    every rank maps ids alike, the table's rank moves its rows and optimizer state to the
    embedding server, and the result equals one process's."""
    one_run = train(tmp_path, "one", nproc=1, micro=2, **hashed_two_ranks.lines)
    two_run = hashed_two_ranks.run
    one, two = weights(one_run), weights(two_run)
    assert one.keys() == two.keys()
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=1e-4, msg=k)
    key = "tables.tables.user_raw_id._extra_state"
    a, b = (
        torch.load(r / "model" / "model.pt", weights_only=True)[key] for r in (one_run, two_run)
    )
    assert len(a["keys"]) == 400 and torch.equal(a["keys"], b["keys"])
    torch.testing.assert_close(b["packed"].view(torch.float32), a["packed"].view(torch.float32),
                               atol=1e-5, rtol=1e-4)  # fmt: skip


LEAVER = """
import logging, sys
from retrieval.training.distributed import init_from_env, leave_job
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
ctx = init_from_env()
rank = ctx.rank if ctx is not None else "alone"
sys.stdout.write(f"rank {rank} done\\n")  # one write: the ranks share the pipe; alone, buffered
logging.getLogger("t").info("logged %s", rank)
leave_job(int(sys.argv[1]))
print("not reached")
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_rank_leaves_with_its_code_and_its_output_flushed(tmp_path, ranks):
    """`leave_job` (how a torchrun rank of `recserve train` ends): the group is destroyed, what
    the rank printed or logged is out, and the process exits with the given code at once (with
    2 ranks, 0: torchrun stops the other rank when one fails)."""
    script = tmp_path / "leave.py"
    script.write_text(LEAVER)
    code = 3 if ranks == 1 else 0
    cmd = [str(script), str(code)]
    if ranks > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *cmd]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # alone: buffered
    out = subprocess.run(
        [sys.executable, *cmd], capture_output=True, text=True, timeout=120,
        env=env | {"PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert out.returncode == code, out.stderr[-2000:]
    names = ["alone"] if ranks == 1 else [0, 1]
    assert sorted(out.stdout.splitlines()) == [f"rank {r} done" for r in names]
    assert all(f"logged {r}" in out.stderr for r in names), out.stderr
