"""Offline batch scoring: the published model over a parquet file of users, resumable.

Input columns (checked before any work, ``retrieval/score_input.py``; an error names the
column):

=============  ==================  ===================================================
column         type                meaning
=============  ==================  ===================================================
``user_id``    int64 or string     echoed to the output
``history``    list<int64>         recent item ids, newest first (the model keeps its window);
                                   raw ids (list<int64> or list<string>) for a model with
                                   id maps (``retrieval/scoring_ids.py``)
``categorical`` list<int64>        one code per categorical user feature, config order
``dense``      list<float>         the model's dense user features
``filter``     string (optional)   a per-user filter; ``--filter`` applies one to all
``seen``       list<int64>         every item the user consumed, never recommended (any
               (optional)          order and length; raw ids like ``history`` for a model
                                   with id maps); exact (``retrieval/seen.py``)
``user``       int64 (optional)    a model with a seen store: the user (dense index) whose
                                   stored items are excluded too (null, ``-1``: none)
=============  ==================  ===================================================

Output: a folder of ``part-NNNNN.parquet`` files (``user_id, item_ids list<int64>,
scores list<float>, model_version``; a model trained on imported data writes its raw item ids,
null where a filter left fewer than K) and ``_manifest.json``, which lists the parts that are
complete. Input chunks of ``chunk_rows`` users are scored by worker processes (each loads the
model once) and each part is written atomically (``common.atomic``), then recorded; a killed
run started again skips the recorded chunks and redoes the rest, so no user is missing or
written twice. Example::

    score(ScoreJob(model_dir=Path("repo/demo/3/model"), version=3, users=Path("users.parquet"),
                   out=Path("recs"), k=100))

``score_ray`` runs the same :func:`score_table` on Ray Data (``read_parquet -> map_batches``
with an actor class that loads the model once -> ``write_parquet``) for a user with a Ray
cluster (``RAY_ADDRESS``; otherwise a local instance, whose start waits for its processes up to
``$RECSERVE_RAY_START_TIMEOUT_S`` and is tried again when it still times out:
``retrieval/ray_start.py``). Its answers equal
the local engine's; it is not resumable (a rerun with ``--overwrite`` redoes the job), and rows
come back in Ray's order.

A published version whose catalog is split into document shards, or whose coldest tables live on
embedding servers, is scored by one all-local model per worker
(:func:`retrieval.artifact.load_whole_model`): ``shards_dir`` / ``embeddings_dir`` name the
version's folders, the shards' parts are merged into the unsharded index in its original order
and the remote tables' rows are read from the servers' folders, so the answers are those of the
unsharded version (and of the router over the shards), with no server running.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from common.atomic import atomic_write_json, atomic_writer, temp_target
from retrieval.ray_start import RAY_START_TIMEOUT_ENV, RayStartTimeout, start_local_ray
from retrieval.score_input import (
    COLUMNS,
    EXPECTED,
    ScoreInputError,
    ScoreJob,
    check_input,
    check_parts,
    check_values,
)
from retrieval.scoring_ids import dense_history, raw_answers

__all__ = [
    "COLUMNS",
    "EXPECTED",
    "MANIFEST",
    "RAY_START_TIMEOUT_ENV",
    "RayStartTimeout",
    "ScoreInputError",
    "ScoreJob",
    "check_input",
    "check_output",
    "check_parts",
    "check_values",
    "read_output",
    "score",
    "score_ray",
    "score_table",
    "users_table",
]

MANIFEST = "_manifest.json"


def users_table(user_ids: np.ndarray, batch: Any) -> pa.Table:
    """The input columns for users ``user_ids [U]`` from their :class:`UserBatch` (``-1`` history
    pads dropped)."""
    return pa.table(
        {
            "user_id": pa.array(user_ids, pa.int64()),
            "history": [h[h >= 0].tolist() for h in batch.history.numpy()],
            "categorical": batch.categorical.numpy().tolist(),
            "dense": pa.array(batch.dense.numpy().tolist(), pa.list_(pa.float32())),
        }
    )


def check_output(job: ScoreJob) -> dict[str, Any]:
    """The manifest to continue from; refuses a foreign or different job's folder."""
    manifest_path = job.out / MANIFEST
    foreign = job.out.exists() and not manifest_path.exists()
    if foreign and not job.overwrite and (not job.out.is_dir() or any(job.out.iterdir())):
        raise ScoreInputError(
            f"--out: {job.out} exists and is not a scoring output (no {MANIFEST}); "
            "pass --overwrite to replace it"
        )
    if job.overwrite and job.out.is_dir():
        for p in job.out.glob("part-*.parquet*"):
            p.unlink()
        manifest_path.unlink(missing_ok=True)
    job.out.mkdir(parents=True, exist_ok=True)
    _remove_unfinished_parts(job.out)
    signature = _signature(job)
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest["job"] != signature:
            raise ScoreInputError(
                f"--out: {job.out} holds the output of another job ({manifest['job']}); "
                "pass --overwrite to replace it"
            )
        return manifest
    return {"job": signature, "done": {}}


def _signature(job: ScoreJob) -> dict[str, Any]:
    """What must match for a run to continue another's output."""
    stat = job.users.stat()
    out = {
        "users": str(job.users.resolve()),
        "users_bytes": stat.st_size,
        "version": job.version,
        "k": job.k,
        "filter": job.filter,
        "chunk_rows": job.chunk_rows,
    }
    if job.recall_target:  # absent at 0: outputs written before the option continue
        out["recall_target"] = job.recall_target
    return out


def _remove_unfinished_parts(out: Path) -> None:
    """Removes the temp files of parts whose writer was killed (no run writes here now: a run
    calls this before it starts its workers)."""
    for p in out.iterdir():
        target = temp_target(p.name)
        if target is not None and (target.startswith("part-") or target == MANIFEST):
            p.unlink(missing_ok=True)


def _write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(out / MANIFEST, manifest, indent=1)


# ---- the work ----------------------------------------------------------------------------------
def chunks(f: pq.ParquetFile, chunk_rows: int) -> Iterator[tuple[int, pa.Table]]:
    """``(chunk index, rows)`` in file order; the same split on every run."""
    for i, batch in enumerate(f.iter_batches(batch_size=chunk_rows)):
        yield i, pa.Table.from_batches([batch])


_MODEL: Any = None  # the worker's model, loaded once per process


def load_job_model(job: ScoreJob) -> Any:
    """The job's model, all-local (shards merged, remote rows read from their folders)."""
    from retrieval.artifact import load_whole_model

    return load_whole_model(job.model_dir, job.shards_dir, job.embeddings_dir, job.device)


def _load_worker(job: ScoreJob, threads: int) -> None:
    global _MODEL
    torch.set_num_threads(threads)
    _MODEL = load_job_model(job)


def score_table(model: Any, table: pa.Table, job: ScoreJob) -> pa.Table:
    """Top-``k`` for every row of ``table`` -> the output columns. Raises ``ValueError``
    naming the column and row of a bad value."""
    from retrieval.features import make_user_batch

    cfg = model.config
    n = table.num_rows
    hist = np.full((n, cfg.history_len), -1, dtype=np.int64)
    lists = table.column("history")
    if model.id_maps is not None:  # raw item ids in, raw item ids out
        lists = dense_history(lists, model.id_maps.items)
    for r, h in enumerate(lists.to_pylist()):
        recent = (h or [])[: cfg.history_len]
        hist[r, : len(recent)] = recent
    cat = _matrix(table, "categorical", len(cfg.user_features), np.int64)
    dense = _matrix(table, "dense", cfg.dense_dim, np.float32)
    filters = _filters(table, job.filter)
    seen, seen_lengths = _seen(table, model)  # [n, S] -1 padded, [n]
    users = _users(table)  # [n] or None
    schema = model.index.schema
    device = model.index.centroids.device
    ids_out: list[np.ndarray] = []
    scores_out = []
    for s in range(0, n, job.batch_size):
        sl = slice(s, s + job.batch_size)
        width = int(seen_lengths[sl].max(initial=0))  # this batch's longest list
        rows = seen[sl, :width] if width else None
        try:
            batch = make_user_batch(hist[sl], cat[sl], dense[sl], schema, filters[sl], rows)
        except ValueError as e:
            raise ValueError(f"filter (rows {s}..): {e}") from None
        if users is not None:
            batch.user = torch.from_numpy(users[sl])
        if job.recall_target:
            batch.recall_target = torch.full((batch.size,), job.recall_target)
        with torch.inference_mode():
            ids, scores = model(batch.to(device), job.k)
        ids_out.append(ids.cpu().numpy())
        scores_out.extend(scores.cpu().numpy().tolist())
    return pa.table(
        {
            "user_id": table.column("user_id"),
            "item_ids": raw_answers(np.concatenate(ids_out), model.id_maps),
            "scores": pa.array(scores_out, type=pa.list_(pa.float32())),
            "model_version": pa.array(np.full(n, job.version, dtype=np.int64)),
        }
    )


def _users(table: pa.Table) -> np.ndarray | None:
    """The ``user`` column -> ``int64 [n]`` (null: ``-1``), or None without one."""
    if "user" not in table.column_names:
        return None
    col = table.column("user").combine_chunks().fill_null(-1)  # checked >= -1 at the start
    return col.to_numpy(zero_copy_only=False).astype(np.int64)


def _seen(table: pa.Table, model: Any) -> tuple[np.ndarray, np.ndarray]:
    """The ``seen`` column -> (``int64 [n, S]`` ``-1`` padded, lengths ``int64 [n]``); a null
    or missing list is empty. Vectorised: one flatten and one masked fill, no loop over ids."""
    n = table.num_rows
    if "seen" not in table.column_names:
        return np.full((n, 0), -1, dtype=np.int64), np.zeros(n, dtype=np.int64)
    lists = table.column("seen").combine_chunks()
    if model.id_maps is not None:
        lists = dense_history(lists, model.id_maps.items, "seen")
    lengths = pc.list_value_length(lists).fill_null(0).to_numpy().astype(np.int64)  # [n]
    values = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    out = np.full((n, int(lengths.max(initial=0))), -1, dtype=np.int64)  # [n, S]
    out[np.arange(out.shape[1])[None, :] < lengths[:, None]] = values
    return out, lengths


def _matrix(table: pa.Table, column: str, width: int, dtype: type) -> np.ndarray:
    rows = table.column(column).to_pylist()
    for r, v in enumerate(rows):
        if v is None or len(v) != width:
            raise ValueError(
                f"{column}: row {r} has {0 if v is None else len(v)} values, expected {width}"
            )
    return np.asarray(rows, dtype=dtype).reshape(len(rows), width)


def _filters(table: pa.Table, common: str | None) -> list[str | None]:
    per_row = table.column("filter").to_pylist() if "filter" in table.column_names else None
    out: list[str | None] = []
    for r in range(table.num_rows):
        parts = [p for p in (common, per_row[r] if per_row else None) if p]
        out.append(" and ".join(parts) or None)  # filters are conjunctions of clauses
    return out


def _score_chunk(index: int, table: pa.Table, job: ScoreJob) -> tuple[int, str, int]:
    """Worker: scores one chunk and writes its part (atomically)."""
    out = score_table(_MODEL, table, job)
    name = f"part-{index:05d}.parquet"
    with atomic_writer(job.out / name) as fh:
        pq.write_table(out, fh)
    return index, name, out.num_rows


def score(job: ScoreJob, progress: bool = True) -> dict[str, Any]:
    """Runs (or continues) the job; returns the manifest. Uses ``job.workers`` processes."""
    from tqdm import tqdm

    f = check_input(job)
    manifest = check_output(job)
    done = {int(i) for i in manifest["done"]}
    total = f.metadata.num_rows
    todo = ((i, t) for i, t in chunks(f, job.chunk_rows) if i not in done)
    already = sum(v["rows"] for v in manifest["done"].values())
    bar = tqdm(total=total, initial=already, unit="users", disable=not progress, desc="scoring")
    threads = max(1, (os.cpu_count() or 1) // max(job.workers, 1))
    ctx = multiprocessing.get_context("spawn")  # torch and fork do not mix
    with ProcessPoolExecutor(
        job.workers,
        mp_context=ctx,
        initializer=_load_worker,
        initargs=(job, threads),
    ) as pool:
        pending = set()
        for i, table in todo:
            pending.add(pool.submit(_score_chunk, i, table, job))
            if len(pending) >= 2 * job.workers:  # bounded memory: a few chunks in flight
                pending = _collect(pending, manifest, job, bar)
        while pending:
            pending = _collect(pending, manifest, job, bar)
    bar.close()
    manifest["complete"] = sum(v["rows"] for v in manifest["done"].values()) == total
    _write_manifest(job.out, manifest)
    return manifest


def _collect(pending: set[Any], manifest: dict[str, Any], job: ScoreJob, bar: Any) -> set[Any]:
    """Waits for one finished chunk (at least) and records it in the manifest."""
    finished, rest = wait(pending, return_when=FIRST_COMPLETED)
    for fut in finished:
        index, name, rows = fut.result()  # a worker's error stops the job (parts so far stay)
        manifest["done"][str(index)] = {"file": name, "rows": rows}
        _write_manifest(job.out, manifest)
        bar.update(rows)
    return rest


def read_output(out: Path) -> pa.Table:
    """Every recorded part, in chunk order."""
    manifest = json.loads((out / MANIFEST).read_text())
    parts = [manifest["done"][k]["file"] for k in sorted(manifest["done"], key=int)]
    return pa.concat_tables([pq.read_table(out / p) for p in parts])


# ---- Ray Data ----------------------------------------------------------------------------------
class _RayScorer:
    """A Ray Data actor: loads the model once, scores batches of rows."""

    def __init__(self, job: ScoreJob, threads: int):
        torch.set_num_threads(threads)
        self.model = load_job_model(job)
        self.job = job

    def __call__(self, batch: pa.Table) -> pa.Table:
        return score_table(self.model, batch, self.job)


def score_ray(job: ScoreJob) -> dict[str, Any]:
    """The job on Ray Data; returns the manifest of the files Ray wrote."""
    import ray

    check_input(job)
    if job.out.exists() and not job.overwrite:
        raise ScoreInputError(
            f"--out: {job.out} exists; the Ray engine needs --overwrite to redo it"
        )
    if job.out.exists():
        for p in job.out.glob("*"):
            if p.is_file():
                p.unlink()
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address)
        else:
            start_local_ray(ray, job.workers)
    threads = max(1, (os.cpu_count() or 1) // max(job.workers, 1))
    ds = ray.data.read_parquet(str(job.users)).map_batches(
        _RayScorer,
        fn_constructor_args=(job, threads),
        batch_format="pyarrow",
        batch_size=job.chunk_rows,
        concurrency=job.workers,
    )
    ds.write_parquet(str(job.out))
    files = sorted(p.name for p in job.out.glob("*.parquet"))
    manifest = {
        "job": _signature(job),
        "engine": "ray",
        "done": {str(i): {"file": f, "rows": pq.ParquetFile(job.out / f).metadata.num_rows}
                 for i, f in enumerate(files)},
        "complete": True,
    }  # fmt: skip
    _write_manifest(job.out, manifest)
    return manifest
