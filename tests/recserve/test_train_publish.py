"""`recserve train` publishes a new version while `recserve serve` (a real process) is under
load: the server swaps to it between batches, and no request fails."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from retrieval.training.run import RunConfig, load_data, prepare_run
from serving.protos.recommend_pb2 import RecommendRequest
from serving.protos.recommend_pb2_grpc import RecommenderStub
from support.process_util import STARTUP_S, serve_cmd, start_server
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

CONFIG = """
[data]
num_users = 300
num_items = 500
[model]
embedding_dim = 16
hidden = [32]
out_dim = 16
history_len = 10
[train]
epochs = 1
batch_size = 128
seed = {seed}
progress = false
[evaluate]
k = 20
[publish]
model_repo = "{repo}"
name = "demo"
table_dtype = "int8"
"""


def train(tmp: Path, seed: int) -> None:
    cfg = tmp / f"train{seed}.toml"
    cfg.write_text(CONFIG.format(seed=seed, repo=tmp / "repo"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recserve",
            "train",
            "--config",
            str(cfg),
            "--out",
            str(tmp / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"published demo v{seed}" in out.stdout


def requests(tmp: Path) -> list[RecommendRequest]:
    cfg = RunConfig.from_toml(tmp / "train1.toml")
    prep = prepare_run(load_data(cfg.data), cfg.model)
    users = np.arange(16)
    batch = prep.user_batch(users)
    return [
        RecommendRequest(
            history=batch.history[i][batch.history[i] >= 0].tolist(),
            categorical=batch.categorical[i].tolist(),
            dense=batch.dense[i].tolist(),
            k=10,
        )
        for i in range(len(users))
    ]


def test_a_published_training_run_is_swapped_in_under_load(tmp_path):
    train(tmp_path, seed=1)
    (tmp_path / "serve.toml").write_text("poll_s = 0.2\n")
    cmd = serve_cmd("--model-repo", tmp_path / "repo", "--grpc-port", "0",
                    "--config", tmp_path / "serve.toml")  # fmt: skip
    proc = start_server(cmd, tmp_path, "serve")
    try:
        address = proc.wait_ready(STARTUP_S).grpc
        reqs = requests(tmp_path)
        versions, failures, stop_load = [], [], threading.Event()

        def load() -> None:
            with grpc.insecure_channel(address) as channel:
                stub = RecommenderStub(channel)
                i = 0
                while not stop_load.is_set():
                    try:
                        versions.append(stub.Recommend(reqs[i % len(reqs)], timeout=10).version)
                    except grpc.RpcError as e:
                        failures.append(e.code())
                    i += 1

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        train(tmp_path, seed=2)  # publishes v2 while the load runs
        wait_until(lambda: versions and versions[-1] == 2, 60, "answers by v2")
        n = len(versions)  # a few more answers: none goes back to v1
        wait_until(lambda: len(versions) >= n + 8, 60, "answers after v2")
        stop_load.set()
        for t in threads:
            t.join(30)
        assert failures == []
        assert versions[0] == 1 and versions[-1] == 2
        assert versions.index(2) > 0 and set(versions) == {1, 2}
    finally:
        proc.stop()
