"""``recserve data``: data sets for the demo, training and tests.

recserve data movielens   extract MovieLens 100k from the recbole wheel into data/ml-100k
recserve data import      a user's own CSV / parquet files -> a data set folder (docs/data.md)

The import's flags are generated from :class:`retrieval.data.import_config.ImportConfig`'s fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from recserve.options import field_option
from retrieval.data.import_config import ImportConfig

data_app = typer.Typer(
    no_args_is_help=True, help="Data sets: fetch them, or import your own (docs/data.md)."
)


@data_app.command("movielens")
def data_movielens(
    out: Path = typer.Option(Path("data/ml-100k"), help="target folder"),
) -> None:
    """Fetch MovieLens 100k (inside the recbole==1.2.1 wheel, from PyPI) into OUT."""
    from retrieval.data.movielens import fetch_movielens

    path = fetch_movielens(out)
    typer.echo(f"MovieLens 100k is in {path}")


def _opt(name: str, override: bool = False) -> Any:
    return field_option(ImportConfig, name, override=override)


@data_app.command("import")
def data_import(
    interactions: Path = _opt("interactions"),
    out: Path = _opt("out"),
    items: Path | None = _opt("items"),
    users: Path | None = _opt("users"),
    user_column: str = _opt("user_column"),
    item_column: str = _opt("item_column"),
    time_column: str = _opt("time_column"),
    label_column: str | None = _opt("label_column", override=True),
    weight_column: str | None = _opt("weight_column", override=True),
    name_column: str | None = _opt("name_column", override=True),
    multi_valued: list[str] = _opt("multi_valued"),
    separator: str = _opt("separator"),
    categorical: list[str] = _opt("categorical"),
    numeric: list[str] = _opt("numeric"),
    buckets: int = _opt("buckets"),
    delimiter: str = _opt("delimiter"),
    history_len: int = _opt("history_len"),
    quiet: bool = typer.Option(False, help="no progress bars"),
) -> None:
    """Import your own interaction log (+ optional items and users files; CSV, TSV or parquet)
    into a data set folder for `recserve train` (source = "parquet", path = OUT) and `recserve
    demo --data OUT`. Every value is checked first: an error names the file, row and column."""
    from retrieval.data.importer import import_data

    given = {
        "interactions": interactions, "out": out, "items": items, "users": users,
        "user_column": user_column, "item_column": item_column, "time_column": time_column,
        "label_column": label_column, "weight_column": weight_column, "name_column": name_column,
        "multi_valued": multi_valued, "separator": separator, "categorical": categorical,
        "numeric": numeric, "buckets": buckets, "delimiter": delimiter, "history_len": history_len,
    }  # fmt: skip
    try:
        cfg = ImportConfig.from_dict({k: v for k, v in given.items() if v is not None})
        report = import_data(cfg, progress=not quiet)
    except ValueError as e:
        typer.echo(f"data import: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo("\n".join(report.lines()))
