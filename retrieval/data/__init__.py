"""Data: the dataset type, a synthetic generator, the MovieLens 100k loader, time splits."""

from retrieval.data.movielens import fetch_movielens, load_movielens
from retrieval.data.schema import Interactions, RecDataset, read_parquet, write_parquet
from retrieval.data.split import history_by_user, split_by_time
from retrieval.data.synthetic import SyntheticConfig, generate

__all__ = [
    "Interactions", "RecDataset", "SyntheticConfig", "fetch_movielens", "generate", "history_by_user",
    "load_movielens", "read_parquet", "split_by_time", "write_parquet",
]
