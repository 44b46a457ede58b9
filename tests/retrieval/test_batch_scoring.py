"""Offline batch scoring: equals per-user answers, survives a kill -9, refuses bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from common.atomic import temp_path
from retrieval.artifact import save_model
from retrieval.batch_scoring import (
    MANIFEST,
    ScoreInputError,
    ScoreJob,
    check_output,
    read_output,
    score,
    users_table,
)
from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.training.prepare import prepare
from support.topk_check import assert_same_topk

K = 20


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    prep = prepare(generate(SyntheticConfig(num_users=200, num_items=400, seed=2)), history_len=8)
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, prep.dataset.item_attributes)
    model.eval()
    save_model(model, root / "model")
    users = np.arange(prep.dataset.num_users)
    table = users_table(users, prep.user_batch(users))
    pq.write_table(table, root / "users.parquet")
    return root, prep, model, table


def job(root: Path, out: str, **kw) -> ScoreJob:
    args = {"chunk_rows": 32, "batch_size": 16, "workers": 2, "k": K, **kw}
    return ScoreJob(root / "model", 1, root / "users.parquet", root / out, **args)


@pytest.mark.slow
@pytest.mark.multiproc  # worker processes
def test_batch_scores_equal_per_user_answers(setup):
    root, prep, model, _ = setup
    score(job(root, "recs", filter="available"), progress=False)
    got = read_output(root / "recs")
    assert got.column("user_id").to_pylist() == list(range(prep.dataset.num_users))
    assert set(got.column("model_version").to_pylist()) == {1}
    for u in (0, 57, 199):
        with torch.inference_mode():
            ids, scores = model(prep.user_batch(np.array([u]), ["available"]), K)
        assert_same_topk(
            torch.tensor([got.column("item_ids")[u].as_py()]),
            torch.tensor([got.column("scores")[u].as_py()]),
            ids,
            scores,
        )


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_killed_run_continues_to_the_same_output(setup, tmp_path):
    root, _, _, _ = setup
    from retrieval.artifact import load_model
    from serving.repository import ModelRepository

    repo = ModelRepository(tmp_path / "repo")
    repo.publish("demo", load_model(root / "model"))
    args = [sys.executable, "-m", "recserve", "score", "--model-repo", str(tmp_path / "repo"),
            "--users", str(root / "users.parquet"), "--out", str(tmp_path / "recs"),
            "--k", str(K), "--chunk-rows", "2", "--workers", "1", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(args, start_new_session=True)
    manifest = tmp_path / "recs" / MANIFEST
    until = time.monotonic() + 120
    while time.monotonic() < until:  # kill -9 once some but not all chunks are recorded
        # 100 chunks of 2 users: a wide window to land the kill in, however fast the machine
        if manifest.exists() and 0 < len(json.loads(manifest.read_text())["done"]) < 60:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    done_before = len(json.loads(manifest.read_text())["done"])
    assert 0 < done_before < 100
    again = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr
    resumed = read_output(tmp_path / "recs")
    whole = ScoreJob(root / "model", 1, root / "users.parquet", tmp_path / "whole", k=K,
                     chunk_rows=2, workers=1)  # fmt: skip
    score(whole, progress=False)
    for column in ("user_id", "item_ids"):  # no user missing, none twice, the same answers
        assert (
            resumed.column(column).to_pylist() == read_output(whole.out).column(column).to_pylist()
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.drop_columns(["dense"]), "column 'dense' is missing"),
        (
            lambda t: t.set_column(1, "history", pa.array(["x"] * t.num_rows)),
            "column 'history' is string",
        ),
    ],
)
def test_a_bad_users_file_is_refused_naming_the_column(setup, tmp_path, change, message):
    root, _, _, table = setup
    pq.write_table(change(table), tmp_path / "bad.parquet")
    bad = ScoreJob(root / "model", 1, tmp_path / "bad.parquet", tmp_path / "out")
    with pytest.raises(ScoreInputError, match=message):
        score(bad, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_existing_folder_without_a_manifest_needs_overwrite(setup, tmp_path):
    root, _, _, _ = setup
    (tmp_path / "recs").mkdir()
    (tmp_path / "recs" / "mine.txt").write_text("keep me")
    j = ScoreJob(root / "model", 1, root / "users.parquet", tmp_path / "recs", k=K, workers=1)
    with pytest.raises(ScoreInputError, match="--overwrite"):
        score(j, progress=False)
    assert (tmp_path / "recs" / "mine.txt").exists()
    score(ScoreJob(**{**j.__dict__, "overwrite": True}), progress=False)
    assert read_output(tmp_path / "recs").num_rows == 200


@pytest.mark.slow
@pytest.mark.multiproc  # a worker process
def test_temp_files_of_killed_writers_are_removed_when_a_job_continues(setup, tmp_path):
    root, _, _, _ = setup
    j = ScoreJob(root / "model", 1, root / "users.parquet", tmp_path / "recs", k=K, workers=1)
    score(j, progress=False)
    parts = sorted(p.name for p in j.out.iterdir())
    killed = [temp_path(j.out / "part-00002.parquet"), temp_path(j.out / MANIFEST)]
    for t in killed:
        t.write_bytes(b"half")
    check_output(j)
    assert sorted(p.name for p in j.out.iterdir()) == parts
    assert read_output(j.out).num_rows == 200


@pytest.mark.slow
@pytest.mark.multiproc  # Ray starts its own processes
def test_the_ray_engine_gives_the_local_engine_answers(setup, tmp_path):
    ray = pytest.importorskip("ray")
    from retrieval.batch_scoring import score_ray

    root, _, _, _ = setup
    local = ScoreJob(root / "model", 1, root / "users.parquet", tmp_path / "local", k=K, workers=1)
    score(local, progress=False)
    remote = ScoreJob(root / "model", 1, root / "users.parquet", tmp_path / "ray", k=K,
                      chunk_rows=64, workers=1)  # fmt: skip
    try:
        manifest = score_ray(remote)
    finally:
        ray.shutdown()
    assert manifest["complete"]
    a = read_output(local.out).sort_by("user_id")
    b = read_output(remote.out).sort_by("user_id")
    assert a.column("user_id").to_pylist() == b.column("user_id").to_pylist()
    assert a.column("item_ids").to_pylist() == b.column("item_ids").to_pylist()
