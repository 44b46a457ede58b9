"""Reading a user's CSV / TSV / parquet file, and its columns checked value by value.

CSV values are read as text, then parsed here, so an error names the file, the row (1: the
first row after the header) and the column, and shows the value::

    clicks.csv: row 17, column "timestamp": "yesterday" is not an integer or ISO time

Parquet columns keep their types (an integer id column stays integers). Files are read in
batches with a progress bar of rows (``tqdm``), so a big file shows how far it is.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

CSV_SUFFIXES = {".csv": None, ".tsv": "\t", ".txt": None}
"""Text suffixes and their forced delimiter (None: the configured one)."""
PARQUET_SUFFIXES = (".parquet", ".pq")
_INT = r"^\s*[+-]?\d+\s*$"
_CANONICAL_INT = r"^-?(0|[1-9]\d{0,17})$"  # no sign, spaces or leading zeros: text == str(int)
_ISO = (
    r"^\s*\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?)?\s*(Z|[+-]\d{2}(:?\d{2})?)?\s*$"
)
_ZONED = r"\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?\s*(Z|[+-]\d{2}(:?\d{2})?)\s*$"
_NUMBER = r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$"


class DataFileError(ValueError):
    """A user's file that cannot be imported; the message names the file, row and column."""


def at(file: str, row: int | None, column: str | None, why: str) -> DataFileError:
    """``"<file>: row <row>, column "<column>": <why>"`` (row 1-based, after the header)."""
    where = [file]
    if row is not None:
        where.append(f" row {row}")
    if column is not None:
        where.append(f' column "{column}"')
    return DataFileError(f"{where[0]}:{','.join(where[1:])}: {why}")


def read_file(path: Path, delimiter: str = ",", progress: bool = False) -> pa.Table:
    """``path`` as a table (CSV: every column a string; parquet: its own types). Refuses, naming
    the file: an unknown suffix, an empty file, a header with a repeated or empty name, a file
    without rows, a CSV row that does not parse."""
    path = Path(path)
    suffix = path.suffix.lower()
    if not path.is_file():
        raise DataFileError(f"{path}: no such file")
    if suffix in PARQUET_SUFFIXES:
        table = _read_parquet(path, progress)
    elif suffix in CSV_SUFFIXES:
        table = _read_csv(path, CSV_SUFFIXES[suffix] or delimiter, progress)
    else:
        known = sorted([*CSV_SUFFIXES, *PARQUET_SUFFIXES])
        raise DataFileError(f"{path}: unknown file type {suffix or '(none)'!r} (known: {known})")
    if table.num_rows == 0:
        raise DataFileError(f"{path}: has a header but no rows")
    return table


def _read_csv(path: Path, delimiter: str, progress: bool) -> pa.Table:
    with path.open(encoding="utf-8", newline="") as f:
        try:
            header = next(csv.reader(f, delimiter=delimiter), None)
        except (UnicodeDecodeError, csv.Error) as e:
            raise DataFileError(f"{path}: cannot read the header: {e}") from None
    if not header or not any(h.strip() for h in header):
        raise DataFileError(f"{path}: empty file (expected a header row)")
    _check_header(path, header)
    opts = pacsv.ConvertOptions(
        column_types={h: pa.string() for h in header},
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )
    parse = pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    batches = []
    try:
        reader = pacsv.open_csv(path, parse_options=parse, convert_options=opts)
        with _bar(path, None, progress) as bar:
            for batch in reader:
                batches.append(batch)
                bar.update(batch.num_rows)
    except pa.ArrowInvalid as e:
        raise DataFileError(f"{path}: not a valid CSV file: {e}") from None
    return pa.Table.from_batches(batches, schema=reader.schema)


def _read_parquet(path: Path, progress: bool) -> pa.Table:
    try:
        f = pq.ParquetFile(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise DataFileError(f"{path}: cannot read as parquet: {e}") from None
    _check_header(path, f.schema_arrow.names)
    batches = []
    with _bar(path, f.metadata.num_rows, progress) as bar:
        for batch in f.iter_batches(batch_size=1 << 16):
            batches.append(batch)
            bar.update(batch.num_rows)
    return pa.Table.from_batches(batches, schema=f.schema_arrow)


def _check_header(path: Path, names: list[str]) -> None:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not name.strip():
            raise DataFileError(f"{path}: column {i + 1} of the header has no name")
        if name in seen:
            raise DataFileError(f'{path}: column "{name}" appears twice in the header')
        seen.add(name)


def _bar(path: Path, total: int | None, progress: bool) -> Any:
    from tqdm import tqdm

    # shown only when reading takes over a second: small files print nothing
    return tqdm(
        total=total, unit=" rows", desc=f"reading {path.name}", disable=not progress, delay=1.0
    )


# ---- columns -------------------------------------------------------------------------------
def column(table: pa.Table, file: str, name: str, flag: str | None = None) -> pa.Array:
    """The column ``name`` as one array; a missing column is refused, naming the columns there
    (and the flag that names it)."""
    if name not in table.column_names:
        hint = f" (set by {flag})" if flag else ""
        raise DataFileError(
            f'{file}: no column "{name}"{hint}; the header has {table.column_names}'
        )
    return table.column(name).combine_chunks()


def _text(col: pa.Array) -> pa.Array:
    return col if pa.types.is_string(col.type) else col.cast(pa.string())


def _first(mask: pa.Array | np.ndarray) -> int:
    """Index of the first True of a bool array."""
    arr = np.asarray(mask.to_numpy(zero_copy_only=False) if isinstance(mask, pa.Array) else mask)
    return int(np.argmax(arr))


def _refuse_empty(col: pa.Array, file: str, name: str) -> None:
    """Null or empty (whitespace) values are refused: ids and times are required."""
    empty = pc.is_null(col)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        empty = pc.or_(empty, pc.equal(pc.utf8_trim_whitespace(col), ""))
    empty = empty.fill_null(True)
    if pc.any(empty).as_py():
        raise at(file, _first(empty) + 1, name, "is empty (a value is required)")


def id_column(table: pa.Table, file: str, name: str, flag: str | None = None) -> pa.Array:
    """Ids ``[M]``: int64 when the column holds integers (CSV: text that is exactly an integer,
    so ``"007"`` stays a string), else strings with surrounding spaces removed."""
    col = column(table, file, name, flag)
    _refuse_empty(col, file, name)
    if pa.types.is_integer(col.type):
        return col.cast(pa.int64())
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise at(file, None, name, f"ids must be integers or strings, got {col.type}")
    text = pc.utf8_trim_whitespace(col.cast(pa.string()))
    if pc.all(pc.match_substring_regex(text, _CANONICAL_INT)).as_py():
        return text.cast(pa.int64())
    return text


def time_column(table: pa.Table, file: str, name: str, flag: str | None = None) -> np.ndarray:
    """Event times ``[M] int64``: integers as they are (seconds), ISO 8601 times (a date, a
    date and time, with an optional zone; none: UTC) as Unix seconds."""
    col = column(table, file, name, flag)
    _refuse_empty(col, file, name)
    if pa.types.is_integer(col.type):
        return np.asarray(col.cast(pa.int64()).to_numpy(), dtype=np.int64)
    if pa.types.is_date(col.type):
        col = col.cast(pa.timestamp("s"))
    if pa.types.is_timestamp(col.type):
        seconds = col.cast(pa.timestamp("s", col.type.tz), safe=False)  # sub-seconds dropped
        return np.asarray(seconds.cast(pa.int64()).to_numpy(), dtype=np.int64)
    if pa.types.is_floating(col.type):
        values = col.to_numpy(zero_copy_only=False)
        bad = values != np.round(values)
        if bad.any():
            raise at(file, _first(bad) + 1, name, f"{values[bad][0]!r} is not a whole second")
        return values.astype(np.int64)
    text = pc.utf8_trim_whitespace(_text(col))
    is_int = pc.match_substring_regex(text, _INT)
    is_iso = pc.match_substring_regex(text, _ISO)
    bad = pc.invert(pc.or_(is_int, is_iso))
    if pc.any(bad).as_py():
        row = _first(bad)
        raise at(file, row + 1, name, f'"{text[row].as_py()}" is not an integer or ISO time')
    out = np.zeros(len(text), dtype=np.int64)
    ints = np.asarray(is_int.to_numpy(zero_copy_only=False))
    if ints.any():
        out[ints] = np.asarray(text.filter(is_int).cast(pa.int64()).to_numpy())
    if not ints.all():
        out[~ints] = _iso_seconds(text.filter(pc.invert(is_int)), np.flatnonzero(~ints), file, name)
    return out


def _iso_seconds(text: pa.Array, rows: np.ndarray, file: str, name: str) -> np.ndarray:
    """ISO times ``[R]`` (shape already checked) -> Unix seconds (floored; no zone: UTC); a
    time that does not exist (month 13) is refused naming its row."""
    zoned = np.asarray(pc.match_substring_regex(text, _ZONED).to_numpy(zero_copy_only=False))
    out = np.zeros(len(text), dtype=np.int64)
    for want, t in ((True, pa.timestamp("ns", "UTC")), (False, pa.timestamp("ns"))):
        part = text.filter(pa.array(zoned == want))
        try:
            ns = np.asarray(part.cast(t).cast(pa.int64()).to_numpy(), dtype=np.int64)
        except pa.ArrowInvalid:
            for i, value in zip(np.flatnonzero(zoned == want), part.to_pylist(), strict=True):
                try:  # the error path: find the row
                    pa.array([value]).cast(t)
                except pa.ArrowInvalid:
                    raise at(
                        file, int(rows[i]) + 1, name, f'"{value}" is not a valid time'
                    ) from None
            raise
        out[zoned == want] = ns // 1_000_000_000
    return out


def float_column(col: pa.Array, file: str, name: str) -> np.ndarray:
    """Numbers ``[M] float64``; empty values are NaN (missing); other text is refused."""
    if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
        return np.asarray(col.cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)
    if pa.types.is_boolean(col.type):
        return np.asarray(col.cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)
    text = pc.utf8_trim_whitespace(_text(col))
    empty = pc.equal(text, "").fill_null(True)
    bad = pc.and_(pc.invert(empty), pc.invert(pc.match_substring_regex(text, _NUMBER)))
    bad = bad.fill_null(False)
    if pc.any(bad).as_py():
        row = _first(bad)
        raise at(file, row + 1, name, f'"{text[row].as_py()}" is not a number')
    values = pc.if_else(empty, pa.scalar(None, pa.string()), text).cast(pa.float64())
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float64)


def is_numeric(col: pa.Array) -> bool:
    """True when every non-empty value is a number (and at least one is there)."""
    if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
        return True
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        return False
    text = pc.utf8_trim_whitespace(col).drop_null()
    text = text.filter(pc.not_equal(text, ""))
    return len(text) > 0 and bool(pc.all(pc.match_substring_regex(text, _NUMBER)).as_py())


def duplicate_rows(ids: pa.Array) -> tuple[int, int] | None:
    """The first two rows (0-based) holding the same id, or None."""
    values = ids.to_numpy(zero_copy_only=False)
    order = np.argsort(values, kind="stable")  # equal ids: in row order
    ordered = values[order]
    same = np.flatnonzero(ordered[1:] == ordered[:-1])  # order[j + 1] repeats an earlier row
    if not same.size:
        return None
    j = same[np.argmin(order[same + 1])]  # the earliest row that repeats an id
    first = int(np.searchsorted(ordered, ordered[j], side="left"))
    return int(order[first]), int(order[j + 1])
