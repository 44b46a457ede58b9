"""``recserve data import``: a user's interaction log (+ optional items and users files) -> a data
set folder that ``recserve train`` (``[data] source = "parquet"``) and ``recserve demo --data``
read. The format is described in ``docs/data.md``.

Steps: read each file (CSV/TSV/parquet, ``retrieval/data/tables.py``) -> check the columns, row
by row (errors name the file, row and column) -> raw ids to dense ids (``IdMaps``, ascending raw
order; an item or user of either file is in the catalog) -> attributes and features encoded
(``retrieval/data/encode.py``) -> :class:`RecDataset` -> written with ``write_parquet`` plus the
id maps, the labels / weights (extra columns of ``interactions.parquet``), ``score_users.parquet``
(every user in ``recserve score``'s input format, raw ids) and ``import_report.json``.

The folder is written beside ``out`` and renamed into place: a failed import leaves no half
folder. An existing ``out`` is replaced only when it is a data set folder (``meta.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retrieval.data.encode import (
    UNKNOWN,
    check_numeric,
    column_kind,
    encode,
    standardize,
    with_unknown,
)
from retrieval.data.encode import buckets as bucketize
from retrieval.data.id_map import IdMap, IdMaps
from retrieval.data.import_config import ImportConfig
from retrieval.data.schema import META_FILE, Interactions, RecDataset, write_parquet
from retrieval.data.score_users import write_score_users
from retrieval.data.tables import (
    DataFileError,
    at,
    column,
    duplicate_rows,
    float_column,
    id_column,
    read_file,
    time_column,
)

REPORT_FILE = "import_report.json"
RESERVED_ITEM = ("item_id", "item_name")


@dataclass
class ImportReport:
    """What an import read and decided (``import_report.json``; printed by the CLI)."""

    folder: str
    users: int
    items: int
    interactions: int
    items_not_in_items_file: int = 0
    """Items of the log absent from the items file (their attributes: ``unknown``)."""
    items_without_interactions: int = 0
    """Items of the items file that no event names (in the catalog: recommendable)."""
    users_not_in_users_file: int = 0
    users_without_interactions: int = 0
    columns: dict[str, str] = field(default_factory=dict)
    """``"<file>: <column>"`` -> how it was read (``"categorical, 12 values"``)."""
    kept: list[str] = field(default_factory=list)
    """Event columns kept in ``interactions.parquet`` but not used by training (label, weight)."""
    user_feature_values: dict[str, list[str]] = field(default_factory=dict)
    """Categorical user feature -> the value of each code (the data set keeps only sizes)."""

    def lines(self) -> list[str]:
        out = [
            f"{self.users} users, {self.items} items, {self.interactions} interactions "
            f"-> {self.folder}"
        ]
        counts = {
            "items in the log but not in the items file (attributes: unknown)": (
                self.items_not_in_items_file
            ),
            "items in the items file without interactions (kept in the catalog)": (
                self.items_without_interactions
            ),
            "users in the log but not in the users file (features: unknown)": (
                self.users_not_in_users_file
            ),
            "users in the users file without interactions (kept)": (
                self.users_without_interactions
            ),
        }
        out += [f"  {n} {what}" for what, n in counts.items() if n]
        out += [f"  {name}: {how}" for name, how in self.columns.items()]
        if self.kept:
            out.append(f"  kept, not used by training yet: {', '.join(self.kept)}")
        return out


@dataclass
class _Log:
    """The interactions file, checked: raw ids ``[M]``, times ``[M] int64``, extra columns."""

    users: pa.Array
    items: pa.Array
    times: np.ndarray
    extra: dict[str, np.ndarray]


@dataclass
class _Side:
    """An optional items or users file: its raw ids ``[R]`` and its other columns."""

    file: str
    ids: pa.Array
    table: pa.Table
    id_column: str


def import_data(cfg: ImportConfig, progress: bool = False) -> ImportReport:
    """Reads the configured files, writes the data set folder ``cfg.out``; returns the report.
    Raises :class:`~retrieval.data.tables.DataFileError` (a ``ValueError``) naming the file, row
    and column of the first bad value, before anything is written."""
    cfg.validate()
    log = _read_log(cfg, progress)
    items = _read_side(cfg.items, cfg.item_column, "--item-column", cfg, progress)
    users = _read_side(cfg.users, cfg.user_column, "--user-column", cfg, progress)
    item_raw, user_raw = _unify(log.items, items), _unify(log.users, users)
    maps = IdMaps(
        IdMap.from_values("user_id", pa.concat_arrays(user_raw)),
        IdMap.from_values("item_id", pa.concat_arrays(item_raw)),
    )
    n, u = len(maps.items), len(maps.users)
    report = ImportReport(str(cfg.out), u, n, len(log.times), kept=sorted(log.extra))
    item_rows = maps.items.to_dense(item_raw[1]) if items else np.zeros(0, np.int64)
    user_rows = maps.users.to_dense(user_raw[1]) if users else np.zeros(0, np.int64)
    label = log.extra.get("label")  # the events' value: what head tasks like value>=1 read
    inter = Interactions(
        maps.users.to_dense(user_raw[0]),
        maps.items.to_dense(item_raw[0]),
        log.times,
        None if label is None else label.astype(np.float32),
    )
    _count_missing(report, inter, n, u, item_rows, user_rows, bool(items), bool(users))
    attrs, vocabs, names = _item_attributes(items, item_rows, n, cfg, report)
    feats, sizes, dense = _user_features(users, user_rows, u, cfg, report)
    ds = RecDataset(
        name=Path(cfg.out).name,
        num_users=u,
        num_items=n,
        item_attributes=attrs,
        attribute_values=vocabs,
        user_features=feats,
        user_feature_sizes=sizes,
        user_dense=dense,
        interactions=inter,
        item_names=names,
        ids=maps,
    )
    _write(ds, log.extra, report, cfg)
    return report


# ---- reading -----------------------------------------------------------------------------------
def _read_log(cfg: ImportConfig, progress: bool) -> _Log:
    path = Path(cfg.interactions)
    table = read_file(path, cfg.delimiter, progress)
    f = str(path)
    users = id_column(table, f, cfg.user_column, "--user-column")
    items = id_column(table, f, cfg.item_column, "--item-column")
    times = time_column(table, f, cfg.time_column, "--time-column")
    extra = {}
    for key, flag in (("label_column", "--label-column"), ("weight_column", "--weight-column")):
        name = getattr(cfg, key)
        if name not in table.column_names:
            if cfg.has_explicit(key):
                column(table, f, name, flag)  # raises: the user named a column that is not there
            continue
        values = float_column(column(table, f, name), f, name)
        missing = np.isnan(values)
        if missing.any():
            raise at(f, int(np.argmax(missing)) + 1, name, "is empty (a number is required)")
        extra[key.removesuffix("_column")] = values
    return _Log(users, items, times, extra)


def _read_side(
    path: Path | None, id_col: str, flag: str, cfg: ImportConfig, progress: bool
) -> _Side | None:
    """An items or users file: ids checked (present, no row twice)."""
    if path is None:
        return None
    table = read_file(Path(path), cfg.delimiter, progress)
    f = str(path)
    ids = id_column(table, f, id_col, flag)
    dup = duplicate_rows(ids)
    if dup is not None:
        raise at(f, dup[1] + 1, id_col, f"{ids[dup[1]].as_py()!r} is also in row {dup[0] + 1}")
    return _Side(f, ids, table, id_col)


def _unify(log_ids: pa.Array, side: _Side | None) -> list[pa.Array]:
    """The log's ids and the file's, of one type: strings if either holds strings."""
    arrays = [log_ids] + ([side.ids] if side is not None else [])
    if any(pa.types.is_string(a.type) for a in arrays):
        return [a.cast(pa.string()) for a in arrays]
    return arrays


def _count_missing(
    report: ImportReport, it: Interactions, n: int, u: int,
    item_rows: np.ndarray, user_rows: np.ndarray, has_items: bool, has_users: bool,
) -> None:  # fmt: skip
    in_log_items = np.bincount(it.item_id, minlength=n) > 0
    in_log_users = np.bincount(it.user_id, minlength=u) > 0
    if has_items:
        listed = np.zeros(n, bool)
        listed[item_rows] = True
        report.items_not_in_items_file = int((in_log_items & ~listed).sum())
        report.items_without_interactions = int((listed & ~in_log_items).sum())
    if has_users:
        listed = np.zeros(u, bool)
        listed[user_rows] = True
        report.users_not_in_users_file = int((in_log_users & ~listed).sum())
        report.users_without_interactions = int((listed & ~in_log_users).sum())


# ---- encoding ----------------------------------------------------------------------------------
def _columns(side: _Side, skip: tuple[str, ...]) -> list[str]:
    return [c for c in side.table.column_names if c != side.id_column and c not in skip]


def _item_attributes(
    side: _Side | None, rows: np.ndarray, n: int, cfg: ImportConfig, report: ImportReport
) -> tuple[dict[str, np.ndarray], dict[str, list[str]], list[str] | None]:
    """Attributes ``[N]`` codes / ``[N, V]`` bool in catalog order, their vocabularies, names."""
    if side is None:
        return {}, {}, None
    names = None
    if cfg.name_column in side.table.column_names:
        text = column(side.table, side.file, cfg.name_column).cast(pa.string()).to_pylist()
        names = [""] * n
        for r, name in zip(rows.tolist(), text, strict=True):
            names[r] = name or ""
    elif cfg.has_explicit("name_column"):
        column(side.table, side.file, cfg.name_column, "--name-column")  # raises
    attrs: dict[str, np.ndarray] = {}
    vocabs: dict[str, list[str]] = {}
    for name in _columns(side, (cfg.name_column,)):
        if name in RESERVED_ITEM:
            raise at(side.file, None, name, "is a reserved name: rename the column")
        col = column(side.table, side.file, name)
        kind = column_kind(col, name, cfg.multi_valued, cfg.categorical, cfg.numeric)
        enc = encode(col, kind, side.file, name, cfg.separator)
        if kind == "multi_valued":
            if not enc.vocab:
                report.columns[f"{side.file}: {name}"] = "multi-valued, no values: left out"
                continue
            matrix = np.zeros((n, len(enc.vocab)), dtype=bool)  # absent items: no value
            matrix[rows] = enc.values
            attrs[name], vocabs[name] = matrix, enc.vocab
            how = f"multi-valued, {len(enc.vocab)} values"
        else:
            codes, vocab = (enc.values, enc.vocab)
            how = f"categorical, {len(vocab)} values"
            if kind == "numeric":
                codes, vocab = bucketize(enc.values, cfg.buckets)
                how = f"numeric: {len(vocab)} quantile buckets ({', '.join(vocab)})"
            full = np.full(n, -1, dtype=np.int64)
            full[rows] = codes
            attrs[name], vocabs[name] = with_unknown(full, vocab)
        report.columns[f"{side.file}: {name}"] = how
    return attrs, vocabs, names


def _user_features(
    side: _Side | None, rows: np.ndarray, u: int, cfg: ImportConfig, report: ImportReport
) -> tuple[dict[str, np.ndarray], dict[str, int], np.ndarray]:
    """Categorical features ``[U]`` codes, their sizes, and dense features ``[U, F] float32``."""
    feats: dict[str, np.ndarray] = {}
    sizes: dict[str, int] = {}
    dense: list[np.ndarray] = []
    for name in _columns(side, ()) if side is not None else []:
        assert side is not None
        if name == "user_id" or name.startswith("dense_"):
            raise at(side.file, None, name, "is a reserved name: rename the column")
        col = column(side.table, side.file, name)
        kind = column_kind(col, name, [], cfg.categorical, cfg.numeric)
        if name in cfg.multi_valued:
            raise at(side.file, None, name, "user features are single-valued")
        enc = encode(col, kind, side.file, name, cfg.separator)
        if kind == "numeric":
            check_numeric(enc.values, side.file, name)
            values = np.full(u, np.nan)
            values[rows] = enc.values
            dense.append(standardize(values))
            report.columns[f"{side.file}: {name}"] = f"numeric: dense feature {len(dense) - 1}"
            continue
        full = np.full(u, -1, dtype=np.int64)
        full[rows] = enc.values
        feats[name], vocab = with_unknown(full, enc.vocab)
        sizes[name] = len(vocab)
        report.user_feature_values[name] = vocab
        report.columns[f"{side.file}: {name}"] = f"categorical, {len(vocab)} values"
    matrix = np.stack(dense, axis=1) if dense else np.zeros((u, 0), np.float32)
    return feats, sizes, matrix.astype(np.float32)


# ---- writing -----------------------------------------------------------------------------------
def _write(
    ds: RecDataset, extra: dict[str, np.ndarray], report: ImportReport, cfg: ImportConfig
) -> None:
    out = Path(cfg.out)
    if out.exists() and not (out / META_FILE).is_file() and any(out.iterdir()):
        raise DataFileError(f"--out: {out} exists and is not a data set folder; choose another")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_parquet(ds, stage)
        if extra:
            path = stage / "interactions.parquet"
            table = pq.read_table(path)
            for key, values in extra.items():
                table = table.append_column(key, pa.array(values, pa.float64()))
            pq.write_table(table, path)
        write_score_users(ds, stage, cfg.history_len)
        (stage / REPORT_FILE).write_text(json.dumps(asdict(report), indent=1), encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


__all__ = ["UNKNOWN", "ImportReport", "import_data"]
