"""Fuzzing the users file of batch scoring: a valid file with random columns dropped or retyped,
nulls (rows and list entries), lists of the wrong length, ids out of range, non-finite dense
features, filters, no rows, and files that are no parquet at all.

:func:`check_input` refuses a bad file before any work with a :class:`ScoreInputError` naming
the column (and the row) that is wrong, and what it accepts the model scores without an error.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from retrieval.artifact import save_model
from retrieval.batch_scoring import (
    COLUMNS,
    ScoreInputError,
    ScoreJob,
    check_input,
    score,
    score_table,
    users_table,
)
from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.training.prepare import prepare

ROWS = 12
FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class Setup:
    def __init__(self, root: Path):
        prep = prepare(
            generate(SyntheticConfig(num_users=60, num_items=150, seed=4)), history_len=6
        )
        torch.manual_seed(0)
        self.model = RetrievalModel(prep.config)
        self.model.build_index(prep.train.item_features, prep.dataset.item_attributes)
        self.model.eval()
        self.root = root
        save_model(self.model, root / "model")
        users = np.arange(ROWS)
        self.table = users_table(users, prep.user_batch(users))
        self.config = prep.config

    def __repr__(self) -> str:  # hypothesis prints every argument of a failing case
        return "setup"

    def job(self, users: Path, **kw) -> ScoreJob:
        return ScoreJob(self.root / "model", 1, users, self.root / "out", k=5, **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return Setup(tmp_path_factory.mktemp("fuzz_users"))


# ---- mutations: (kind, column, row, value choice) ------------------------------------------------
RETYPES = {
    "string": (pa.string(), lambda w: "7"),
    "float64": (pa.float64(), lambda w: 1.5),
    "int32": (pa.int32(), lambda w: 1),
    "bool": (pa.bool_(), lambda w: True),
    "list<string>": (pa.list_(pa.string()), lambda w: ["1"] * w),
    "list<int32>": (pa.list_(pa.int32()), lambda w: [1] * w),
    "list<uint64>": (pa.list_(pa.uint64()), lambda w: [1] * w),
    "list<float64>": (pa.list_(pa.float64()), lambda w: [0.5] * w),
    "large_list<int64>": (pa.large_list(pa.int64()), lambda w: [1] * w),
}
"""Another type for a column, with values of the right shape (width ``w``) for it."""
BAD_IDS = [-2, 150, 151, 2**31, 2**63 - 1, -(2**63)]
BAD_FLOATS = [math.nan, math.inf, -math.inf, 1e39]
FLOAT32_MAX = float(np.finfo(np.float32).max)
FILTERS = ["available", "language = en", "", "not available and region != eu",
           "language = xx", "colour = red", "language in {en", "and", "'"]  # fmt: skip
"""Per-row filters: the first four are valid ("": none)."""
KINDS = ["null_row", "null_entry", "length", "bad_value", "retype", "drop", "filter", "no_rows"]

mutations = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.sampled_from([*COLUMNS, "filter"]),
        st.integers(0, ROWS - 1),
        st.integers(0, 100),
    ),
    max_size=3,
)


def mutate(setup: Setup, table: pa.Table, plan: list) -> pa.Table:
    """Applies ``plan``: a list of (kind, column, row, pick)."""
    widths = {"categorical": len(setup.config.user_features), "dense": setup.config.dense_dim}
    for kind, column, row, pick in plan:
        if kind == "no_rows":
            table = table.slice(0, 0)
            continue
        if kind == "filter":
            texts = ["available"] * table.num_rows
            if table.num_rows:
                texts[row % table.num_rows] = FILTERS[pick % len(FILTERS)]
            if "filter" in table.column_names:
                table = table.drop_columns(["filter"])
            table = table.append_column("filter", pa.array([t or None for t in texts], pa.string()))
            continue
        if column not in table.column_names or not table.num_rows:
            continue
        i = table.column_names.index(column)
        field_type = table.schema.field(column).type
        values = table.column(column).to_pylist()
        row %= len(values)
        is_list = pa.types.is_list(field_type) or pa.types.is_large_list(field_type)
        if kind == "drop":
            table = table.drop_columns([column])
            continue
        if kind == "retype" and column != "filter":
            new_type, make = RETYPES[list(RETYPES)[pick % len(RETYPES)]]
            array = pa.array([make(widths.get(column, 2)) for _ in values], new_type)
            table = table.set_column(i, column, array)
            continue
        if kind == "null_row":
            values[row] = None
        elif kind == "null_entry" and is_list and values[row]:
            values[row][pick % len(values[row])] = None
        elif kind == "length" and is_list and values[row] is not None:
            values[row] = values[row][:-1] if pick % 2 and values[row] else [*values[row], 0]
        elif kind == "bad_value" and is_list and values[row]:
            value_type = field_type.value_type
            if pa.types.is_floating(value_type):
                value = BAD_FLOATS[pick % len(BAD_FLOATS)]
            elif pa.types.is_unsigned_integer(value_type):
                value = 2**64 - 1 - pick
            elif pa.types.is_int32(value_type):
                value = [-2, 150, 2**31 - 1][pick % 3]
            elif pa.types.is_integer(value_type):
                value = BAD_IDS[pick % len(BAD_IDS)]
            else:
                continue
            values[row][pick % len(values[row])] = value
        else:
            continue
        table = table.set_column(i, column, pa.array(values, field_type))
    return table


def expected_bad(setup: Setup, table: pa.Table) -> set[str]:
    """A plain reference of the checks, row by row: the columns a refusal may name."""
    names, cfg = table.column_names, setup.config
    bad = {c for c, ok in COLUMNS.items() if c not in names or not ok(table.schema.field(c).type)}
    if "filter" in names and not pa.types.is_string(table.schema.field("filter").type):
        bad.add("filter")
    if bad:
        return bad  # types are checked first, then rows
    if table.num_rows == 0:
        return {"no rows"}
    cards = list(cfg.user_features.values())
    for row in table.to_pylist():
        if row["user_id"] is None:
            bad.add("user_id")
        if any(v is None or not -1 <= v < cfg.num_items for v in row["history"] or []):
            bad.add("history")
        codes = row["categorical"] or []
        in_range = [v is not None and -1 <= v < n for v, n in zip(codes, cards, strict=False)]
        if row["categorical"] is None or len(codes) != len(cards) or not all(in_range):
            bad.add("categorical")
        dense = row["dense"] or []
        finite = [v is not None and abs(v) <= FLOAT32_MAX for v in dense]  # NaN is not
        if row["dense"] is None or len(dense) != cfg.dense_dim or not all(finite):
            bad.add("dense")
        if row.get("filter"):
            try:
                setup.model.index.schema.compile([row["filter"]])
            except ValueError:
                bad.add("filter")
    return bad


@pytest.mark.slow
@FUZZ
@given(mutations)
def test_bad_users_files_are_refused_naming_the_column(setup, tmp_path, plan):
    table = mutate(setup, setup.table, plan)
    bad = expected_bad(setup, table)
    path = tmp_path / "users.parquet"
    pq.write_table(table, path)
    job = setup.job(path)
    try:
        f = check_input(job)
    except ScoreInputError as e:
        message = str(e)
        named = {c for c in [*COLUMNS, "filter"] if f"column {c!r}" in message}
        if message.endswith("has no rows"):
            named.add("no rows")
        event(f"refused: {sorted(named)}")
        assert len(named) == 1 and named <= bad, f"{message!r}; bad: {bad}"
        return
    event("accepted")
    assert not bad, f"accepted a file with bad {bad}"
    assert f.metadata.num_rows == table.num_rows
    out = score_table(setup.model, table, job)  # what check_input passes, the model scores
    assert out.num_rows == table.num_rows


@settings(max_examples=40, deadline=None, database=None)
@given(st.binary(max_size=64) | st.sampled_from([b"", b"PAR1", b"PAR1\x00\x00\x00\x00PAR1"]))
def test_files_that_are_no_parquet_are_refused(setup, tmp_path_factory, data):
    path = tmp_path_factory.mktemp("users") / "users.parquet"
    path.write_bytes(data)
    with pytest.raises(ScoreInputError, match=r"^--users: cannot read"):
        check_input(setup.job(path))


def test_a_bad_file_is_refused_before_any_work(setup, tmp_path):
    """``score`` itself: refused before the output folder exists or a worker starts."""
    table = mutate(setup, setup.table, [("bad_value", "history", 3, 1)])
    pq.write_table(table, tmp_path / "users.parquet")
    job = ScoreJob(setup.root / "model", 1, tmp_path / "users.parquet", tmp_path / "out")
    with pytest.raises(ScoreInputError, match=r"column 'history', row 3: id 150 is not in"):
        score(job, progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ScoreInputError, match=r"^--filter: unknown attribute 'colour'"):
        check_input(setup.job(tmp_path / "users.parquet", filter="colour = red"))
