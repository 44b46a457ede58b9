"""``recserve data import``'s settings: which files, which columns, how attributes are read.

One typed :class:`ImportConfig`; the CLI's flags are generated from its fields
(``recserve/options.py``), so a flag's help is the field's docstring. The format itself is
described in ``docs/data.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import Field, ValidationInfo, field_validator

from common.config import Config, ConfigError, PathValue

ColumnName = Annotated[str, Field(min_length=1)]


class ImportConfig(Config):
    """Where a user's own files are and how to read them."""

    flags: ClassVar[dict[str, str]] = {
        "interactions": "--interactions",
        "items": "--items",
        "users": "--users",
        "out": "--out",
        "user_column": "--user-column",
        "item_column": "--item-column",
        "time_column": "--time-column",
        "label_column": "--label-column",
        "weight_column": "--weight-column",
        "name_column": "--name-column",
        "multi_valued": "--multi-valued",
        "separator": "--separator",
        "categorical": "--categorical",
        "numeric": "--numeric",
        "buckets": "--buckets",
        "delimiter": "--delimiter",
        "history_len": "--history-len",
    }

    interactions: PathValue
    """The interaction log: CSV/TSV (header row) or parquet, one event per row."""
    out: PathValue
    """The data set folder to write (``[data] source = "parquet"``, ``demo --data``)."""
    items: PathValue | None = None
    """Optional items file: the item id column, then attributes (categorical, multi-valued or
    numeric)."""
    users: PathValue | None = None
    """Optional users file: the user id column, then features (categorical, or numeric: dense)."""
    user_column: ColumnName = "user_id"
    """Column of the user id (interactions and users file); integers or strings."""
    item_column: ColumnName = "item_id"
    """Column of the item id (interactions and items file); integers or strings."""
    time_column: ColumnName = "timestamp"
    """Column of the event time: an integer (seconds) or an ISO 8601 time."""
    label_column: ColumnName = "label"
    """Optional numeric label of an event, read when present: kept, and the interactions'
    ``value`` that head tasks such as ``value>=1`` learn (``retrieval/training/task_labels.py``)."""
    weight_column: ColumnName = "weight"
    """Optional numeric weight of an event (kept, not used by training yet); read when present."""
    name_column: ColumnName = "name"
    """Items file column of display names (not an attribute); read when present."""
    multi_valued: list[ColumnName] = Field(default_factory=list)
    """Attribute columns holding several values per row, joined by the separator (repeatable)."""
    separator: str = Field(default="|", min_length=1)
    """Separator of the values of a multi-valued attribute."""
    categorical: list[ColumnName] = Field(default_factory=list)
    """Columns read as categories even though every value is a number (repeatable)."""
    numeric: list[ColumnName] = Field(default_factory=list)
    """Columns read as numbers even with few distinct integer values (repeatable)."""
    buckets: int = Field(default=8, ge=2, le=256)
    """Quantile buckets of a numeric item attribute (items: categorical codes for the filter)."""
    delimiter: str = Field(default=",", min_length=1, max_length=1)
    """Field delimiter of CSV files (``.tsv`` files use a tab)."""
    history_len: int = Field(default=200, ge=1)
    """Most recent items per user written to ``score_users.parquet``."""

    @field_validator("numeric")
    @classmethod
    def _not_both(cls, value: list[str], info: ValidationInfo) -> list[str]:
        both = sorted(set(value) & set(info.data.get("categorical", [])))
        if both:
            raise ValueError(f"{both} also named by categorical")
        return value

    def validate(self) -> None:  # type: ignore[override]  # pydantic's is a deprecated v1 name
        """The input files exist (errors name the flag)."""
        for name in ("interactions", "items", "users"):
            path: Path | None = getattr(self, name)
            if path is not None and not path.is_file():
                raise ConfigError(f"{self.flags[name]}: {path} is not a file")

    def has_explicit(self, field: str) -> bool:
        """True when ``field`` was given (not its default): a missing column it names is an
        error then, where a default one is simply absent."""
        return field in self.model_fields_set
