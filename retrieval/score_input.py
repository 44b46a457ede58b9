"""An offline scoring job (:class:`ScoreJob`) and its users file checked before any work: the
columns' presence and types, then every value against the model's config, with errors that name
the column and row (:class:`ScoreInputError`). The format: ``retrieval/batch_scoring.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from retrieval.data.id_map import IdMaps
from retrieval.scoring_ids import dense_history, first_unknown, history_expected, history_type_ok

COLUMNS: dict[str, Callable[[pa.DataType], bool]] = {
    "user_id": lambda t: (
        pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
    ),
    "history": lambda t: pa.types.is_list(t) and pa.types.is_integer(t.value_type),
    "categorical": lambda t: pa.types.is_list(t) and pa.types.is_integer(t.value_type),
    "dense": lambda t: pa.types.is_list(t) and pa.types.is_floating(t.value_type),
}
OPTIONAL = ("filter", "seen", "user")
"""Columns a users file may leave out: ``filter`` string (per-user filter), ``seen``
``list<int64>`` (every item the user consumed, never recommended; raw ids like ``history``),
``user`` int64 (a model with a seen store: the user whose stored items are excluded; null or
``-1``: none)."""
ID_LISTS = ("history", "seen")
"""Columns of item id lists (raw ids for a model with id maps)."""
EXPECTED = {
    "user_id": "int64 or string",
    "history": "list<int64>",
    "categorical": "list<int64>",
    "dense": "list<float>",
}


@dataclass(frozen=True)
class ScoreJob:
    model_dir: Path
    """The version's model folder (``retrieval.artifact.save_model`` layout; for a
    document-sharded version, the router part)."""
    version: int
    users: Path
    out: Path
    k: int = 100
    filter: str | None = None
    chunk_rows: int = 4096
    batch_size: int = 256
    workers: int = 2
    overwrite: bool = False
    shards_dir: Path | None = None
    """A document-sharded version's shards folder (``<shards_dir>/<s>/``): merged in each worker."""
    embeddings_dir: Path | None = None
    """The version's embedding-server folders (``server-<i>/``) when its plan has remote tables:
    read into each worker (no server needed)."""
    recall_target: float = 0.0
    """Recall@K against exact search every user asks for, in (0, 1] (1: exact); 0: the
    model's index settings (``retrieval/index/targets.py``)."""
    device: str = "cpu"
    """Where each worker runs the model (``cpu``, ``cuda``, ``cuda:N``); on a GPU one worker
    is usually enough (``recserve score --device cuda --workers 1``)."""


class ScoreInputError(ValueError):
    """The users file or the output folder cannot be used (the message names the column)."""


def check_input(job: ScoreJob) -> pq.ParquetFile:
    """Opens the users file and checks it before any work: the columns' presence and types, then
    every value against the model's ``config.json`` (:func:`check_values`)."""
    try:
        f = pq.ParquetFile(job.users)
    except (OSError, pa.ArrowInvalid) as e:
        raise ScoreInputError(f"--users: cannot read {job.users} as parquet: {e}") from None
    schema = f.schema_arrow
    maps = _model_maps(job)
    for name, ok in COLUMNS.items():
        want = history_expected(maps) if name == "history" else EXPECTED[name]
        if name not in schema.names:
            raise ScoreInputError(f"--users: column {name!r} is missing ({want})")
        t = schema.field(name).type
        if not (history_type_ok(t, maps) if name == "history" else ok(t)):
            raise ScoreInputError(f"--users: column {name!r} is {t}, expected {want}")
    if "seen" in schema.names and not history_type_ok(schema.field("seen").type, maps):
        want = history_expected(maps)
        raise ScoreInputError(
            f"--users: column 'seen' is {schema.field('seen').type}, expected {want}"
        )
    if "user" in schema.names:
        _check_user_column(schema.field("user").type, job)
    if "filter" in schema.names and not pa.types.is_string(schema.field("filter").type):
        raise ScoreInputError(
            f"--users: column 'filter' is {schema.field('filter').type}, expected string"
        )
    if job.k < 1:
        raise ScoreInputError(f"--k: must be >= 1, got {job.k}")
    if f.metadata.num_rows == 0:
        raise ScoreInputError(f"--users: {job.users} has no rows")
    check_values(f, job)
    return f


def _check_user_column(t: pa.DataType, job: ScoreJob) -> None:
    """The ``user`` column: integers, for a model that keeps a seen store."""
    from retrieval.artifact import CONFIG_FILE
    from retrieval.format import load_config

    if not pa.types.is_integer(t):
        raise ScoreInputError(f"--users: column 'user' is {t}, expected int64")
    try:
        stored = load_config(job.model_dir / CONFIG_FILE).seen_store
    except (OSError, ValueError, TypeError) as e:
        raise ScoreInputError(f"model_dir: {e}") from None
    if not stored:
        raise ScoreInputError(
            "--users: column 'user' names users of a seen store, and this model keeps none "
            "(model.seen_store): give their lists in 'seen'"
        )


def _model_maps(job: ScoreJob) -> Any:
    """The model folder's id maps (None: dense ids); errors name the folder."""
    from retrieval.artifact import CONFIG_FILE, read_id_maps
    from retrieval.format import load_config

    try:
        return read_id_maps(job.model_dir, load_config(job.model_dir / CONFIG_FILE))
    except (OSError, ValueError, TypeError) as e:
        raise ScoreInputError(f"model_dir: {e}") from None


def check_values(f: pq.ParquetFile, job: ScoreJob) -> None:
    """Reads the file's input columns once (in batches) and refuses, naming the column and row:
    a null ``user_id``, ``categorical`` or ``dense`` (a null ``history`` or ``seen`` is empty, a
    null ``filter`` none); a null inside a list; ``categorical`` / ``dense`` of another length
    than the model's; a history or seen id outside ``[-1, num_items)`` (raw ids: one the model
    does not know); a categorical code outside
    ``[-1, cardinality)`` (plain tables: a table plan may hash them); a dense value that is not a
    finite float32; a filter (or ``--filter``) that does not parse or names an unknown attribute
    or value. The workers trust what passes (they would fail mid-job, or index out of range)."""
    from retrieval.artifact import CONFIG_FILE
    from retrieval.filters import FilterSchema, filter_vocabulary
    from retrieval.format import load_config

    path = job.model_dir / CONFIG_FILE
    try:
        cfg = load_config(path)
    except (OSError, ValueError, TypeError) as e:
        raise ScoreInputError(f"model_dir: cannot read {path}: {e}") from None
    check_parts(job, cfg)
    maps = _model_maps(job)
    schema = FilterSchema(
        filter_vocabulary(cfg.item_attributes, cfg.numeric_attributes), cfg.index.hashed_min_values
    )
    if job.filter:
        _check_filter(job.filter, schema, "--filter")
    _check_target(job.recall_target, cfg)
    columns = [c for c in (*COLUMNS, *OPTIONAL) if c in f.schema_arrow.names]
    start = 0
    for batch in f.iter_batches(batch_size=65_536, columns=columns):
        _check_batch(batch, start, cfg, schema, maps)
        start += batch.num_rows


def _check_target(target: float, cfg: Any) -> None:
    """``--recall-target``: 0, or in (0, 1] with a model whose build measured a recall curve
    (1, exact, needs none)."""
    if not 0.0 <= target <= 1.0:
        raise ScoreInputError(
            f"--recall-target: must be in (0, 1] (0: the index's settings), got {target}"
        )
    if 0.0 < target < 1.0 and not cfg.index.target_recall:  # the build measured no curve
        raise ScoreInputError(
            "--recall-target: the model's index measured no recall curve at build "
            "(IVFConfig.target_recall was 0): use 0 (its settings) or 1 (exact)"
        )


def check_parts(job: ScoreJob, cfg: Any) -> None:
    """The folders a sharded or tiered version needs are given and there (a worker that cannot
    load its model would only say that its process pool broke)."""
    from retrieval.artifact import SHARD_INDEX_FILE, ShardMap, remote_tables

    smap = ShardMap.read(job.model_dir)
    if smap is not None:
        if job.shards_dir is None:
            raise ScoreInputError(
                f"model_dir: {job.model_dir} is the router part of {smap.num_shards} document "
                "shards; give shards_dir, the version's shards folder"
            )
        for s in range(smap.num_shards):
            if not (job.shards_dir / str(s) / SHARD_INDEX_FILE).is_file():
                raise ScoreInputError(
                    f"shards_dir: shard {s} is missing ({job.shards_dir / str(s)})"
                )
    remote = sorted(remote_tables(cfg))
    if remote and job.embeddings_dir is None:
        raise ScoreInputError(
            f"embeddings_dir: tables {remote} live on embedding servers; give the version's "
            "embedding-server folders"
        )


def _check_batch(
    batch: pa.RecordBatch, start: int, cfg: Any, schema: Any, maps: IdMaps | None
) -> None:
    """:func:`check_values` of rows ``start ..`` of the file (``maps``: the history holds raw
    item ids, each one the model's)."""

    def refuse(column: str, row: int, why: str) -> ScoreInputError:
        return ScoreInputError(f"--users: column {column!r}, row {start + row}: {why}")

    widths = {"categorical": len(cfg.user_features), "dense": cfg.dense_dim}
    id_lists = [c for c in ID_LISTS if c in batch.schema.names]  # history, and seen if given
    id_ranges: dict[str, list[tuple[int, int] | None]] = (
        {c: [(-1, cfg.num_items)] for c in id_lists} if maps is None else {}
    )
    for name in id_lists:
        unknown = None if maps is None else first_unknown(batch.column(name), maps.items)
        if unknown is not None:
            row, raw = unknown
            raise refuse(name, row, f"item {raw!r} is not in the model's catalog")
    if cfg.table_plan is None:  # a hashed feature's raw ids are any int64: not checked
        id_ranges["categorical"] = [
            None if f in cfg.hashed_user_features else (-1, n) for f, n in cfg.user_features.items()
        ]
    for name in ("user_id", "categorical", "dense"):
        nulls = batch.column(name).is_null().to_numpy(zero_copy_only=False)
        if nulls.any():
            raise refuse(name, int(np.argmax(nulls)), "is null")
    if "user" in batch.schema.names:  # a dense user index, or -1 / null: none
        users = batch.column("user").fill_null(-1).to_numpy(zero_copy_only=False)
        if (users < -1).any():
            at = int(np.argmax(users < -1))
            raise refuse("user", at, f"{int(users[at])} is no user index (>= 0, or -1: none)")
    for name in (*id_lists, "categorical", "dense"):
        lists = batch.column(name)
        if name in ID_LISTS and maps is not None:
            lists = dense_history(lists, maps.items, name)  # known ids (checked above)
        rows = pc.list_parent_indices(lists).to_numpy()  # value -> its row
        values = pc.list_flatten(lists)
        if values.null_count:
            at = int(np.argmax(values.is_null().to_numpy(zero_copy_only=False)))
            raise refuse(name, int(rows[at]), "holds a null")
        if name in widths:
            lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
            wrong = np.flatnonzero(lengths != widths[name])
            if wrong.size:
                got = int(lengths[wrong[0]])
                raise refuse(name, int(wrong[0]), f"has {got} values, expected {widths[name]}")
        v = values.to_numpy(zero_copy_only=False)
        if name == "dense":
            with np.errstate(over="ignore"):
                finite = np.isfinite(v.astype(np.float32))
            if not finite.all():
                at = int(np.argmin(finite))
                raise refuse(name, int(rows[at]), f"{v[at]} is not a finite float32")
        step = widths.get(name, 1)  # categorical: feature j of row r is value r * F + j
        for j, bounds in enumerate(id_ranges.get(name, [])):
            if bounds is None:
                continue
            lo, hi = bounds
            ids = v[j::step]
            out = (ids >= hi) if ids.dtype.kind == "u" else (ids < lo) | (ids >= hi)
            if out.any():
                at = int(np.argmax(out))
                feature = f" (feature {j})" if name == "categorical" else ""
                row = int(rows[j::step][at])
                raise refuse(name, row, f"id {ids[at]}{feature} is not in [{lo}, {hi})")
    if "filter" in batch.schema.names:
        texts = batch.column("filter")
        for text in pc.unique(texts.drop_null()).to_pylist():
            try:
                _check_filter(text, schema, "filter")
            except ScoreInputError as e:
                row = pc.index(texts, text).as_py()
                raise refuse("filter", row, str(e).removeprefix("filter: ")) from None


def _check_filter(text: str, schema: Any, where: str) -> None:
    from retrieval.filters import parse_filter

    try:
        schema.check(parse_filter(text))
    except ValueError as e:
        raise ScoreInputError(f"{where}: {str(e).removeprefix('filter: ')}") from None
