"""``[data] source = "parquet"``: an imported folder, refused at config load when it is not one;
``load_data`` reads it with its raw ids, and a model trained on it carries them."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError
from retrieval.data.import_config import ImportConfig
from retrieval.data.importer import import_data
from retrieval.training.config import RunConfig
from retrieval.training.run import load_data


def imported(tmp: Path) -> Path:
    log = tmp / "clicks.csv"
    log.write_text("user_id,item_id,timestamp\nann,sku-2,1\nann,sku-1,2\nbo,sku-2,3\n")
    import_data(ImportConfig(interactions=log, out=tmp / "shop"))
    return tmp / "shop"


def config(tmp: Path, data: str) -> RunConfig:
    path = tmp / "train.toml"
    path.write_text(f"[data]\n{data}\n")
    return RunConfig.from_toml(path)


def test_an_imported_folder_loads_with_its_raw_ids(tmp_path: Path) -> None:
    folder = imported(tmp_path)
    cfg = config(tmp_path, f'source = "parquet"\npath = "{folder}"')
    ds = load_data(cfg.data)
    assert (ds.num_users, ds.num_items, len(ds.interactions)) == (2, 2, 3)
    assert ds.ids is not None and ds.ids.items.raw.to_pylist() == ["sku-1", "sku-2"]
    assert ds.user_dense.shape == (2, 0) and ds.user_features == {}  # no users file


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ('source = "parquet"', "data.path: required with source = 'parquet'"),
        ('source = "parquet"\npath = "{tmp}/nope"', "data.path: {tmp}/nope is not a folder"),
        ('source = "parquet"\npath = "{tmp}"', "data.path: {tmp} is not a data set folder: no meta.json"),
        ('path = "{tmp}"', "data.path: only with source = 'parquet'"),
        ('source = "parquet"\npath = "{tmp}/shop"\nnum_users = 3',
         "data.num_users: unknown key for source = 'parquet' (known: path)"),
        ('source = "movielens"\npath = "{tmp}"', "data.path: only with source = 'parquet'"),
    ],
)  # fmt: skip
def test_a_missing_or_foreign_folder_is_refused_at_load(
    tmp_path: Path, data: str, message: str
) -> None:
    imported(tmp_path)  # {tmp}/shop is a data set folder, {tmp} is not
    with pytest.raises(ConfigError) as e:
        config(tmp_path, data.format(tmp=tmp_path))
    assert message.format(tmp=tmp_path) in str(e.value)
