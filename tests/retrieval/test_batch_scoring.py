"""Offline batch scoring: equals per-user answers, survives a kill -9, refuses bad input; a
document-sharded version with remote tables answers as the unsharded one."""

from __future__ import annotations

import copy
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
from retrieval.artifact import SHARD_ROWS_FILE, load_whole_model, save_model, save_sharded
from retrieval.batch_scoring import (
    MANIFEST,
    ScoreInputError,
    ScoreJob,
    check_input,
    check_output,
    read_output,
    score,
    score_table,
    users_table,
)
from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel, table_specs
from retrieval.tiering import tier_model
from retrieval.training.prepare import prepare
from sharded_tables.export import write_server_folders
from sharded_tables.placement import Budgets, PlacementPlan
from sharded_tables.specs import DType
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


class PackedRows:
    """The embedding servers' rows, in this process (the reference's remote tier)."""

    def __init__(self, packed: dict[str, torch.Tensor]):
        self.packed = packed

    def fetch(self, ids_by_table, timeout=None):
        return {t: self.packed[t][ids] for t, ids in ids_by_table.items()}


@pytest.fixture(scope="module")
def tiered(setup):
    """The demo's production shape: INT8 tables, the item table on the host, the colder ones on
    one embedding server -> (reference model with its remote rows in memory, rows, plan)."""
    _, _, model, _ = setup
    item = next(s for s in table_specs(model.config, DType.INT8) if s.name == "item")
    budgets = Budgets(device=0, host=int(item.bytes(DType.INT8) * 1.01),
                      remote_per_server=64 << 20, remote_servers=1)  # fmt: skip
    ref, remote_rows = tier_model(model, budgets, dtype=DType.INT8)
    assert remote_rows, "the plan puts no table on the embedding server"
    ref.tables.remote = PackedRows(remote_rows)
    return ref, remote_rows, PlacementPlan.from_dict(ref.config.table_plan)


@pytest.fixture(scope="module")
def sharded(setup, tiered):
    """``<root>/sharded``: the tiered model split into 2 document shards, its remote rows in
    server folders (a published version's model/, shards/, embeddings/)."""
    root, _, _, _ = setup
    ref, remote_rows, plan = tiered
    vdir = root / "sharded"
    save_sharded(ref, vdir / "model", vdir / "shards", 2)
    write_server_folders(plan, table_specs(ref.config), remote_rows, vdir / "embeddings")
    return vdir


def reference(model, table: pa.Table, j: ScoreJob) -> pa.Table:
    """What one process answers with ``model`` (the same 16-user batches as the workers)."""
    return score_table(model, table, j)


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


def test_a_seen_column_is_never_recommended_and_equals_the_model_with_seen(setup, tmp_path):
    """In process (``score_table``): rows of different seen lengths (one null, one empty) in one
    batch; each batch pads to its own longest list."""
    root, prep, model, table = setup
    users = np.arange(40)
    top, _ = model(prep.user_batch(users), K)
    rng = np.random.default_rng(1)
    lists: list[list[int] | None] = [
        rng.permutation(np.r_[row[: u % 7], rng.choice(400, u % 5)]).tolist() for u, row in
        zip(users.tolist(), top.numpy(), strict=True)
    ]  # fmt: skip
    lists[3], lists[4] = None, []
    seen_table = table.slice(0, len(users)).append_column(
        "seen", pa.array(lists, pa.list_(pa.int64()))
    )
    got = score_table(model, seen_table, job(root, "unused", batch_size=16))
    for u in users.tolist():
        seen = [] if lists[u] is None else lists[u]
        batch = prep.user_batch(np.array([u]))
        batch.seen = torch.tensor([seen or [-1]], dtype=torch.int64)
        with torch.inference_mode():
            ids, scores = model(batch, K)
        row = got.column("item_ids")[u].as_py()
        assert not set(row) & set(seen)
        assert_same_topk(
            torch.tensor([row]), torch.tensor([got.column("scores")[u].as_py()]), ids, scores
        )


@pytest.mark.parametrize(
    ("seen", "message"),
    [
        (
            pa.array([["1"]] * 200),
            r"column 'seen' is list<element: string>, expected list<int64> of item ids",
        ),
        (pa.array([[3, 400]] + [[]] * 199), r"column 'seen', row 0: id 400 is not in \[-1, 400\)"),
        (
            pa.array([[]] * 5 + [[1, None]] + [[]] * 194, pa.list_(pa.int64())),
            r"column 'seen', row 5: holds a null",
        ),
    ],
)
def test_a_bad_seen_column_is_refused_naming_it(setup, tmp_path, seen, message):
    root, _, _, table = setup
    pq.write_table(table.append_column("seen", seen), tmp_path / "bad.parquet")
    bad = ScoreJob(root / "model", 1, tmp_path / "bad.parquet", tmp_path / "out")
    with pytest.raises(ScoreInputError, match=message):
        check_input(bad)


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
def test_the_ray_engine_gives_the_local_engine_answers(setup, tiered, sharded, tmp_path):
    ray = pytest.importorskip("ray")
    from retrieval.batch_scoring import score_ray

    root, _, _, table = setup
    local = ScoreJob(root / "model", 1, root / "users.parquet", tmp_path / "local", k=K, workers=1)
    score(local, progress=False)
    remote = ScoreJob(root / "model", 1, root / "users.parquet", tmp_path / "ray", k=K,
                      chunk_rows=64, workers=1)  # fmt: skip
    # the sharded version with remote tables: each actor merges the shards, reads the rows
    whole = sharded_job(sharded, tmp_path / "ray-sharded", chunk_rows=64, workers=1)
    try:
        manifest = score_ray(remote)
        assert score_ray(whole)["complete"]
    finally:
        ray.shutdown()
    assert manifest["complete"]
    assert_same_answers(read_output(whole.out), reference(tiered[0], table, whole))
    a = read_output(local.out).sort_by("user_id")
    b = read_output(remote.out).sort_by("user_id")
    assert a.column("user_id").to_pylist() == b.column("user_id").to_pylist()
    assert a.column("item_ids").to_pylist() == b.column("item_ids").to_pylist()


def sharded_job(vdir: Path, out: Path, **kw) -> ScoreJob:
    args = {"chunk_rows": 32, "batch_size": 16, "workers": 2, "k": K,
            "shards_dir": vdir / "shards", "embeddings_dir": vdir / "embeddings", **kw}  # fmt: skip
    return ScoreJob(vdir / "model", 2, vdir.parent / "users.parquet", out, **args)


def assert_same_answers(got: pa.Table, want: pa.Table) -> None:
    got, want = got.sort_by("user_id"), want.sort_by("user_id")
    for column in ("user_id", "item_ids", "scores"):
        assert got.column(column).to_pylist() == want.column(column).to_pylist(), column


def test_the_whole_model_of_a_sharded_tiered_version_is_the_unsharded_one(setup, tiered, sharded):
    root, _, _, table = setup
    ref, _, _ = tiered
    whole = load_whole_model(sharded / "model", sharded / "shards", sharded / "embeddings")
    want, got = ref.index.state_dict(), whole.index.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items() if isinstance(v, torch.Tensor))
    j = sharded_job(sharded, root / "unused", filter="available")
    assert_same_answers(reference(whole, table, j), reference(ref, table, j))
    # versions published before rows.pt (format 0): lists in item-id order, the build's order
    for s in (0, 1):
        (sharded / "shards" / str(s) / SHARD_ROWS_FILE).rename(root / f"rows-{s}.pt")
    config = sharded / "model" / "config.json"
    written = config.read_text()
    try:
        with pytest.raises(FileNotFoundError, match=r"0/rows.pt: missing"):  # format 1 has them
            load_whole_model(sharded / "model", sharded / "shards", sharded / "embeddings")
        unversioned = {k: v for k, v in json.loads(written).items() if k != "format"}
        config.write_text(json.dumps(unversioned))
        again = load_whole_model(sharded / "model", sharded / "shards", sharded / "embeddings")
        assert torch.equal(again.index.item_ids, ref.index.item_ids)
    finally:
        config.write_text(written)
        for s in (0, 1):
            (root / f"rows-{s}.pt").rename(sharded / "shards" / str(s) / SHARD_ROWS_FILE)


def test_a_sharded_or_tiered_version_needs_its_folders(setup, sharded, tmp_path):
    with pytest.raises(ScoreInputError, match="router part of 2 document shards"):
        score(sharded_job(sharded, tmp_path / "a", shards_dir=None), progress=False)
    with pytest.raises(ScoreInputError, match="live on embedding servers"):
        score(sharded_job(sharded, tmp_path / "b", embeddings_dir=None), progress=False)
    with pytest.raises(ScoreInputError, match="shard 0 is missing"):
        score(sharded_job(sharded, tmp_path / "c", shards_dir=tmp_path), progress=False)
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.slow
@pytest.mark.multiproc  # worker processes
def test_a_published_sharded_version_with_remote_tables_scores_as_the_unsharded_one(
    setup, tiered, tmp_path
):
    """The demo's version shape, through ``recserve score``: 2 document shards, remote tables."""
    from typer.testing import CliRunner

    from recserve.cli import app
    from serving.repository import ModelRepository

    root, _, _, table = setup
    ref, remote_rows, _ = tiered
    repo = ModelRepository(tmp_path / "repo")
    repo.publish("demo", ref, shards=2, remote_rows=remote_rows)
    out = tmp_path / "recs"
    args = ["score", "--model-repo", str(tmp_path / "repo"), "--users", str(root / "users.parquet"),
            "--out", str(out), "--k", str(K), "--chunk-rows", "32", "--workers", "2", "--quiet"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    got = read_output(out)
    assert set(got.column("model_version").to_pylist()) == {1}
    # the CLI scores each chunk of 32 users as one batch: the reference batches them alike
    assert_same_answers(
        got, reference(ref, table, sharded_job(root / "sharded", out, batch_size=32))
    )


def test_a_user_column_reads_the_models_seen_store(setup, tmp_path):
    """A model with a seen store: rows naming their ``user`` (null: none) answer like the model
    given those users; the check refuses ``user`` for a model without a store, and bad values."""
    from retrieval.seen_store import SeenStore

    root, prep, model, table = setup
    stored = copy.deepcopy(model)
    stored.config.seen_store = True
    stored.seen_store = SeenStore.from_sets(prep.seen)
    save_model(stored, tmp_path / "stored")
    users = pa.array([u if u % 3 else None for u in range(table.num_rows)], pa.int64())
    pq.write_table(table.append_column("user", users), tmp_path / "users.parquet")
    j = ScoreJob(tmp_path / "stored", 1, tmp_path / "users.parquet", tmp_path / "out", k=K)
    check_input(j)
    got = score_table(stored, pq.read_table(tmp_path / "users.parquet"), j)
    rows = np.arange(12)
    batch = prep.user_batch(rows)
    batch.user = torch.tensor([u if u % 3 else -1 for u in rows.tolist()])
    with torch.inference_mode():
        want, _ = stored(batch, K)
    assert [got.column("item_ids")[int(u)].as_py() for u in rows] == want.tolist()
    with pytest.raises(ScoreInputError, match="this model keeps none"):
        check_input(ScoreJob(root / "model", 1, tmp_path / "users.parquet", tmp_path / "o2"))
    bad = users.fill_null(-5)
    pq.write_table(table.append_column("user", bad), tmp_path / "bad.parquet")
    with pytest.raises(ScoreInputError, match=r"column 'user', row 0: -5 is no user index"):
        check_input(ScoreJob(tmp_path / "stored", 1, tmp_path / "bad.parquet", tmp_path / "o3"))


def test_a_recall_target_of_one_scores_exactly(setup):
    root, prep, model, table = setup
    j = job(root, "exact", recall_target=1.0)
    check_input(j)
    got = score_table(model, table.slice(0, 32), j)
    with torch.inference_mode():
        want, _ = model(prep.user_batch(np.arange(32)), K, exact=True)
    assert got.column("item_ids").to_pylist() == want.tolist()
    with pytest.raises(ScoreInputError, match="--recall-target: must be in"):
        check_input(job(root, "bad", recall_target=1.5))
