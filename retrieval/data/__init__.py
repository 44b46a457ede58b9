"""Data: the dataset type and its parquet form, a synthetic generator, MovieLens 100k, time splits.

``RecDataset`` is what every later part reads: item attributes (filterable), user features,
and the timed interaction log. Sources: :func:`generate` (seeded synthetic traffic) and
:func:`load_movielens` (after :func:`fetch_movielens`).
"""

from retrieval.data.movielens import fetch_movielens, load_movielens
from retrieval.data.schema import Interactions, RecDataset, read_parquet, write_parquet
from retrieval.data.split import history_by_user, split_by_time
from retrieval.data.synthetic import SyntheticConfig, generate, item_topics

__all__ = [
    "Interactions",
    "RecDataset",
    "SyntheticConfig",
    "fetch_movielens",
    "generate",
    "history_by_user",
    "item_topics",
    "load_movielens",
    "read_parquet",
    "split_by_time",
    "write_parquet",
]
