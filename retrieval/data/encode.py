"""Attribute and feature columns -> the codes the model reads.

* categorical: values -> codes into the sorted vocabulary of the values seen;
* multi-valued (values joined by a separator, e.g. ``"Comedy|Drama"``): a bool ``[R, V]`` matrix;
* numeric item attributes: ``buckets`` quantile buckets -> categorical codes labelled by their
  range (``"10..25"``): the item side of the model and the eligibility filter read categories
  (``price = "10..25"``);
* numeric user features: standardized dense features (the user tower reads dense inputs).

Missing values (empty text, null, or a row absent from the file) become the value ``unknown``
(multi-valued: no value; dense: 0, the mean). A column is numeric when every value is a number,
unless it holds integers with at most :data:`MAX_INT_CATEGORIES` distinct values (codes such as
``category = 3``); ``--categorical`` / ``--numeric`` decide for a column.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from retrieval.data.tables import at, float_column, is_numeric

UNKNOWN = "unknown"
MAX_INT_CATEGORIES = 32
Kind = Literal["categorical", "multi_valued", "numeric"]


@dataclass
class Encoded:
    """One column of R rows, encoded.

    kind: how it was read. values: categorical ``[R] int64`` codes (``-1``: missing),
    multi-valued ``[R, V] bool``, numeric ``[R] float64`` (NaN: missing). vocab: the value of
    each code (categorical, multi-valued); numeric: empty.
    """

    kind: Kind
    values: np.ndarray
    vocab: list[str]


def column_kind(
    col: pa.Array, name: str, multi: list[str], categorical: list[str], numeric: list[str]
) -> Kind:
    """How column ``name`` is read (the lists: the columns the user named)."""
    if name in multi:
        return "multi_valued"
    if name in numeric:
        return "numeric"
    if name in categorical or not is_numeric(col):
        return "categorical"
    values = _text(col).drop_null()
    values = values.filter(pc.not_equal(values, ""))
    is_int = pc.all(pc.match_substring_regex(values, r"^[+-]?\d+$")).as_py()
    if is_int and len(pc.unique(values)) <= MAX_INT_CATEGORIES:
        return "categorical"
    return "numeric"


def encode(col: pa.Array, kind: Kind, file: str, name: str, separator: str) -> Encoded:
    """Reads one column as ``kind``; a numeric column with text is refused naming the row."""
    if kind == "numeric":
        return Encoded(kind, float_column(col, file, name), [])
    if kind == "multi_valued":
        matrix, vocab = multi_valued(col, separator)
        return Encoded(kind, matrix, vocab)
    codes, vocab = categorical(col)
    return Encoded(kind, codes, vocab)


def _text(col: pa.Array) -> pa.Array:
    text = col if pa.types.is_string(col.type) else col.cast(pa.string())
    return pc.utf8_trim_whitespace(text)


def categorical(col: pa.Array) -> tuple[np.ndarray, list[str]]:
    """Values ``[R]`` -> codes ``[R] int64`` (``-1``: missing) and the sorted vocabulary."""
    text = _text(col)
    present = pc.and_(pc.is_valid(text), pc.not_equal(text, "")).fill_null(False)
    vocab = sorted(pc.unique(text.filter(present)).to_pylist())
    codes = pc.index_in(text, value_set=pa.array(vocab, pa.string()))
    out = np.asarray(codes.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
    out[~np.asarray(present.to_numpy(zero_copy_only=False))] = -1
    return out, vocab


def multi_valued(col: pa.Array, separator: str) -> tuple[np.ndarray, list[str]]:
    """``"a|b"`` values ``[R]`` -> a bool matrix ``[R, V]`` over the sorted vocabulary (a value
    repeated in one row counts once; empty parts are dropped)."""
    text = _text(col).fill_null("")
    parts = pc.split_pattern(text, separator)  # [R] lists
    rows = np.asarray(pc.list_parent_indices(parts).to_numpy(), dtype=np.int64)
    values = pc.utf8_trim_whitespace(pc.list_flatten(parts))
    keep = pc.not_equal(values, "")
    rows = rows[np.asarray(keep.to_numpy(zero_copy_only=False))]
    values = values.filter(keep)
    vocab = sorted(pc.unique(values).to_pylist())
    codes = np.asarray(pc.index_in(values, value_set=pa.array(vocab, pa.string())).to_numpy())
    matrix = np.zeros((len(text), len(vocab)), dtype=bool)
    matrix[rows, codes.astype(np.int64)] = True
    return matrix, vocab


def buckets(values: np.ndarray, count: int) -> tuple[np.ndarray, list[str]]:
    """Numbers ``[R]`` (NaN: missing) -> codes ``[R] int64`` of at most ``count`` quantile
    buckets (``-1``: missing) and their labels ``"lo..hi"`` (the last bucket includes hi); with
    ``count`` distinct values or fewer, one bucket per value, labelled by the value."""
    known = values[~np.isnan(values)]
    out = np.full(values.shape, -1, dtype=np.int64)
    if not known.size:
        return out, []
    distinct = np.unique(known)  # ascending
    if len(distinct) <= count:  # few values: one bucket each
        out[~np.isnan(values)] = np.searchsorted(distinct, known)
        return out, [f"{v:.6g}" for v in distinct]
    edges = np.unique(np.quantile(known, np.linspace(0, 1, count + 1)))  # ascending
    inner = edges[1:-1]
    codes = np.searchsorted(inner, values, side="right")
    out[~np.isnan(values)] = codes[~np.isnan(values)]
    labels = [f"{lo:.4g}..{hi:.4g}" for lo, hi in itertools.pairwise(edges)]
    if len(set(labels)) < len(labels):  # %g rounding merged two edges: fall back to positions
        labels = [f"q{j + 1}" for j in range(len(labels))]
    return out, labels


def standardize(values: np.ndarray) -> np.ndarray:
    """Numbers ``[R]`` (NaN: missing) -> ``(x - mean) / std`` ``[R] float32``, missing -> 0."""
    known = values[~np.isnan(values)]
    if not known.size:
        return np.zeros(values.shape, dtype=np.float32)
    std = float(known.std())
    out = (values - float(known.mean())) / (std if std > 0 else 1.0)
    return np.nan_to_num(out, nan=0.0).astype(np.float32)


def with_unknown(codes: np.ndarray, vocab: list[str]) -> tuple[np.ndarray, list[str]]:
    """Codes ``[R]`` with ``-1`` for missing -> the code of ``unknown`` there (added to the
    vocabulary if needed); at least one value, so every feature has a vocabulary."""
    if (codes >= 0).all() and vocab:
        return codes, vocab
    vocab = list(vocab)
    if UNKNOWN not in vocab:
        vocab.append(UNKNOWN)
    return np.where(codes < 0, vocab.index(UNKNOWN), codes).astype(np.int64), vocab


def check_numeric(values: np.ndarray, file: str, name: str) -> None:
    """Refuses an infinite number (a dense feature must be finite), naming the row."""
    bad = np.isinf(values)
    if bad.any():
        row = int(np.argmax(bad))
        raise at(file, row + 1, name, f"{values[row]!r} is not a finite number")
