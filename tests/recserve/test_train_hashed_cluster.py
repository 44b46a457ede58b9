"""Issue 16's whole path over real processes: a training store, `torchrun --nproc_per_node 2 -m
recserve train` of a model with a hashed raw-id user table (its working table on one rank, the
rest of its rows and their optimizer state on the store), publishing by `[publish]`'s plan (the
hashed table on an embedding server, keyed), and `recserve cluster up` answering by raw id like
the trained model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from recserve.cluster import Cluster
from retrieval.artifact import load_model
from retrieval.training.run import RunConfig, load_data, prepare_run
from serving.protos.recommend_pb2 import RecommendRequest
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository import ModelRepository
from support.process_util import STARTUP_S, recserve_cmd, start_server
from support.train_runs import train_cmd

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(400)]

CONFIG = """
[data]
num_users = 400
num_items = 500
[model]
embedding_dim = 16
hidden = [32]
out_dim = 16
history_len = 10
hashed_user_id = 128
[train]
epochs = 1
batch_size = 128
progress = false
[train.hashed]
servers = ["{store}"]
[evaluate]
k = 20
[publish]
model_repo = "{repo}"
name = "hashed"
shards = 1
table_dtype = "fp16"
host_budget = "24KiB"
embedding_servers = 1
server_budget = "1MiB"
"""
K, USERS = 10, 16


def recserve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args], capture_output=True, text=True, timeout=timeout
    )


def test_torchrun_trains_publishes_and_a_cluster_serves_hashed_ids(tmp_path: Path) -> None:
    store = start_server(
        recserve_cmd("serve", "training-store", "--folder", tmp_path / "store",
                     "--table", "user_raw_id:17", "--grpc-port", "0"),
        tmp_path, "store",
    )  # fmt: skip
    try:
        ready = store.wait_ready(STARTUP_S)
        cfg = tmp_path / "train.toml"
        cfg.write_text(CONFIG.format(store=ready.grpc, repo=tmp_path / "repo"))
        out = subprocess.run(
            train_cmd(cfg, tmp_path / "run", 2), capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert "tables ['user_raw_id'] on 1 embedding servers" in out.stdout
    finally:
        store.stop(timeout_s=5.0)

    repo = ModelRepository(tmp_path / "repo")
    vdir = repo.version_dir("hashed", 1)
    assert (vdir / "embeddings" / "server-0").is_dir()  # the hashed table's keyed rows

    run_cfg = RunConfig.from_toml(cfg)
    prep = prepare_run(load_data(run_cfg.data), run_cfg.model)
    batch = prep.user_batch(np.arange(USERS))
    trained = load_model(tmp_path / "run" / "model")
    with torch.no_grad():
        want, _ = trained(batch, K)

    d = tmp_path / "cluster"
    up = recserve(
        "cluster", "up", "--model-repo", str(repo.root), "--shards", "1",
        "--embedding-servers", "1", "--directory", str(d), "--state-dir", str(tmp_path / "st"),
    )  # fmt: skip
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        stub = RecommenderStub(grpc.insecure_channel(Cluster.load(d).router.address))
        got = []
        for i in range(USERS):
            req = RecommendRequest(
                history=batch.history[i][batch.history[i] >= 0].tolist(),
                categorical=batch.categorical[i].tolist(),  # the last one: the raw user id
                dense=batch.dense[i].tolist(),
                k=K,
            )
            got.append(list(stub.Recommend(req, timeout=30).item_ids))
    finally:
        down = recserve("cluster", "down", "--directory", str(d))
        assert down.returncode == 0, down.stderr
    overlap = [len(set(g) & set(w.tolist())) / K for g, w in zip(got, want, strict=True)]
    assert float(np.mean(overlap)) > 0.9  # fp16 rows served against the float model
