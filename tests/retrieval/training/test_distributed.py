"""`recserve train` as 2 processes (torchrun, gloo) equals 1 process with 2 micro-batches;
bad configs are refused at start naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiproc

CONFIG = """
[data]
source = "synthetic"
num_users = 400
num_items = 600
[model]
embedding_dim = 16
hidden = [32]
out_dim = 16
history_len = 10
[train]
epochs = 2
batch_size = 128
micro_batches = {micro}
random_negatives = 16
progress = false
[evaluate]
k = 50
"""


def train(tmp: Path, name: str, micro: int, nproc: int) -> dict[str, torch.Tensor]:
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG.format(micro=micro))
    cmd = ["-m", "recserve", "train", "--config", str(cfg), "--out", str(tmp / name)]
    if nproc > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(tmp / name / "model" / "model.pt", weights_only=True)


def test_two_processes_train_the_same_model_as_one(tmp_path):
    one = train(tmp_path, "one", micro=2, nproc=1)
    two = train(tmp_path, "two", micro=1, nproc=2)
    weights = [
        k for k, t in one.items() if isinstance(t, torch.Tensor) and not k.startswith("index.")
    ]
    assert any(k.startswith("tables.") for k in weights)
    for k in weights:
        # the same math; only the order of float sums differs (all_reduce of the dense
        # gradients, gathered table gradients summed per row): ~1e-7 per step after 2 epochs
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
