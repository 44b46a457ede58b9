"""recserve data import: any log the format allows round-trips through the data set folder with
its raw ids; every bad input is refused before anything is written, naming file, row, column."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrieval.data import read_parquet
from retrieval.data.import_config import ImportConfig
from retrieval.data.importer import REPORT_FILE, import_data
from retrieval.data.score_users import SCORE_USERS_FILE
from retrieval.data.tables import DataFileError

T0 = 1_700_000_000


def write(path: Path, columns: dict[str, list]) -> Path:
    """``columns`` as a CSV (text) or parquet (typed) file, by the path's suffix."""
    if path.suffix == ".parquet":
        pq.write_table(pa.table(columns), path)
        return path
    names = list(columns)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(names)
        w.writerows(zip(*(columns[n] for n in names), strict=True))
    return path


def do_import(tmp: Path, **kw: object) -> Path:
    out = tmp / "out"
    import_data(ImportConfig(out=out, **kw))  # type: ignore[arg-type]
    return out


# ---- any shape the format allows ---------------------------------------------------------------
@st.composite
def logs(draw: st.DrawFn) -> dict:
    string_ids = draw(st.booleans())
    n_users, n_items = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    user = (lambda i: f"user {i}") if string_ids else (lambda i: 100 + 7 * i)
    item = (lambda i: f"sku-{i}") if draw(st.booleans()) else (lambda i: i * 3)
    m = draw(st.integers(1, 25))
    events = draw(
        st.lists(st.tuples(st.integers(0, n_users - 1), st.integers(0, n_items - 1)),
                 min_size=m, max_size=m)
    )  # fmt: skip
    # a side file lists some items / users of the log and some the log lacks (never none: a
    # file without rows is refused)
    listed_items = draw(st.sets(st.integers(0, n_items + 2), min_size=1, max_size=n_items + 3))
    listed_users = draw(st.sets(st.integers(0, n_users + 2), min_size=1, max_size=n_users + 3))
    tags = {i: draw(st.sets(st.sampled_from("abc"), max_size=3)) for i in listed_items}
    return {
        "suffix": draw(st.sampled_from([".csv", ".parquet"])),
        "events": [(user(u), item(i), T0 + 60 * j) for j, (u, i) in enumerate(events)],
        "items": {item(i): (f"c{i % 2}", sorted(tags[i])) for i in sorted(listed_items)}
        if draw(st.booleans()) else None,
        "users": {user(u): f"r{u % 3}" for u in sorted(listed_users)}
        if draw(st.booleans()) else None,
    }  # fmt: skip


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(logs())
def test_every_event_attribute_and_feature_survives_with_its_raw_ids(
    tmp_path_factory: pytest.TempPathFactory, log: dict
) -> None:
    tmp = tmp_path_factory.mktemp("imp")
    sfx = log["suffix"]
    users, items, times = zip(*log["events"], strict=True)
    kw: dict = {
        "interactions": write(
            tmp / f"log{sfx}",
            {"user_id": list(users), "item_id": list(items), "timestamp": list(times)},
        )
    }
    if log["items"] is not None:
        ids = list(log["items"])
        kw["items"] = write(tmp / f"items{sfx}", {
            "item_id": ids,
            "genre": [log["items"][i][0] for i in ids],
            "tags": ["|".join(log["items"][i][1]) for i in ids],
        })  # fmt: skip
        kw["multi_valued"] = ["tags"]
    if log["users"] is not None:
        uids = list(log["users"])
        kw["users"] = write(
            tmp / f"users{sfx}", {"user_id": uids, "region": [log["users"][u] for u in uids]}
        )
    ds = read_parquet(do_import(tmp, **kw))
    assert ds.ids is not None
    raw_users = ds.ids.users.raw.to_pylist()
    raw_items = ds.ids.items.raw.to_pylist()
    it = ds.interactions
    got = sorted(zip((raw_users[u] for u in it.user_id), (raw_items[i] for i in it.item_id),
                     it.timestamp.tolist(), strict=True))  # fmt: skip
    assert got == sorted(log["events"])
    expect_items = set(items) | set(log["items"] or {})
    assert {str(x) for x in raw_items} == {str(x) for x in expect_items}
    if log["items"] is not None:
        genre = ds.item_attributes["genre"]
        no_tags = not any(t for _, t in log["items"].values())
        assert ("tags" in ds.item_attributes) != no_tags  # a column without values is left out
        tags = ds.item_attributes.get("tags", np.zeros((ds.num_items, 0), bool))
        for d, raw in enumerate(raw_items):
            want = log["items"].get(raw) if raw in log["items"] else None
            shown = ds.attribute_values["genre"][genre[d]]
            assert shown == (want[0] if want else "unknown")
            vocab = ds.attribute_values.get("tags", [])
            values = [v for v, on in zip(vocab, tags[d], strict=True) if on]
            assert values == (want[1] if want else [])
    if log["users"] is not None:
        report = json.loads((tmp / "out" / REPORT_FILE).read_text())
        vocab = report["user_feature_values"]["region"]
        assert len(vocab) == ds.user_feature_sizes["region"]
        for d, raw in enumerate(raw_users):
            want = log["users"].get(raw, "unknown")
            assert vocab[ds.user_features["region"][d]] == want
    score = pq.read_table(tmp / "out" / SCORE_USERS_FILE)
    assert score.column("user_id").to_pylist() == raw_users


def test_report_counts_what_each_file_lacks(tmp_path: Path) -> None:
    log = write(tmp_path / "log.csv", {"user_id": ["a", "b"], "item_id": ["x", "y"],
                                       "timestamp": [1, 2]})  # fmt: skip
    items = write(tmp_path / "items.csv", {"item_id": ["x", "z"], "kind": ["k1", "k2"]})
    users = write(tmp_path / "users.csv", {"user_id": ["a", "c", "d"], "age": [30, 40, 50]})
    report = import_data(ImportConfig(interactions=log, items=items, users=users,
                                      out=tmp_path / "o", numeric=["age"]))  # fmt: skip
    assert (report.items, report.users) == (3, 4)
    assert report.items_not_in_items_file == 1 and report.items_without_interactions == 1
    assert report.users_not_in_users_file == 1 and report.users_without_interactions == 2
    ds = read_parquet(tmp_path / "o")
    assert ds.user_dense.shape == (4, 1)  # age: numeric -> dense; user b (missing) -> 0
    assert ds.user_dense[1, 0] == 0.0


def test_times_integer_or_iso_and_labels_kept(tmp_path: Path) -> None:
    log = write(tmp_path / "log.csv", {
        "user_id": [1, 1, 1, 1], "item_id": [1, 2, 3, 4],
        "timestamp": ["1704067200", "2024-01-01", "2024-01-01T01:00:00+01:00",
                      "2024-01-01 00:00:30Z"],
        "label": [1, 0, 1, 0.5],
    })  # fmt: skip
    out = do_import(tmp_path, interactions=log)
    assert read_parquet(out).interactions.timestamp.tolist() == [1704067200] * 3 + [1704067230]
    table = pq.read_table(out / "interactions.parquet")
    assert table.column("label").to_pylist() == [1.0, 0.0, 1.0, 0.5]
    value = read_parquet(out).interactions.value  # what head tasks (value>=1) read
    assert value is not None and value.tolist() == [1.0, 0.0, 1.0, 0.5]


def test_numeric_item_attribute_becomes_quantile_buckets(tmp_path: Path) -> None:
    n = 40
    log = write(tmp_path / "log.csv", {"user_id": [0] * n, "item_id": list(range(n)),
                                       "timestamp": list(range(n))})  # fmt: skip
    items = write(tmp_path / "items.csv", {"item_id": list(range(n)),
                                           "price": [i * 2.5 for i in range(n)]})  # fmt: skip
    ds = read_parquet(do_import(tmp_path, interactions=log, items=items, buckets=4))
    codes = ds.item_attributes["price"]
    assert len(ds.attribute_values["price"]) == 4 and np.all(np.diff(codes) >= 0)
    assert np.bincount(codes).tolist() == [10, 10, 10, 10]


# ---- each bad input, refused at start ----------------------------------------------------------
GOOD: dict[str, list] = {"user_id": ["a", "b"], "item_id": ["x", "y"], "timestamp": [10, 20]}


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({**GOOD, "timestamp": [10, "yesterday"]},
         'clicks.csv: row 2, column "timestamp": "yesterday" is not an integer or ISO time'),
        ({**GOOD, "timestamp": [10, "2024-13-01"]},
         'clicks.csv: row 2, column "timestamp": "2024-13-01" is not a valid time'),
        ({"user_id": ["a"], "item_id": ["x"]},
         'clicks.csv: no column "timestamp" (set by --time-column)'),
        ({**GOOD, "item_id": ["x", " "]},
         'clicks.csv: row 2, column "item_id": is empty'),
        ({**GOOD, "label": ["1", "good"]}, 'clicks.csv: row 2, column "label": "good" is not a number'),
    ],
)  # fmt: skip
def test_bad_log_values_name_file_row_and_column(
    tmp_path: Path, columns: dict, message: str
) -> None:
    log = write(tmp_path / "clicks.csv", columns)
    with pytest.raises(DataFileError) as e:
        do_import(tmp_path, interactions=log)
    assert str(e.value).startswith(f"{log}: {message.removeprefix('clicks.csv: ')}")
    assert not (tmp_path / "out").exists()  # nothing written


def test_empty_header_only_and_unknown_files(tmp_path: Path) -> None:
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "header.csv").write_text("user_id,item_id,timestamp\n")
    (tmp_path / "log.json").write_text("{}")
    (tmp_path / "dup.csv").write_text("user_id,user_id,timestamp\n1,2,3\n")
    cases = {
        "empty.csv": "empty.csv: empty file",
        "header.csv": "header.csv: has a header but no rows",
        "log.json": "log.json: unknown file type '.json'",
        "dup.csv": 'dup.csv: column "user_id" appears twice',
    }
    for name, message in cases.items():
        with pytest.raises(DataFileError, match=message):
            do_import(tmp_path, interactions=tmp_path / name)


def test_duplicate_item_rows_and_bad_attributes_are_refused(tmp_path: Path) -> None:
    log = write(tmp_path / "log.csv", GOOD)
    items = write(tmp_path / "items.csv", {"item_id": ["x", "y", "x"], "kind": ["a", "b", "c"]})
    with pytest.raises(
        DataFileError, match=r"items.csv: row 3, column \"item_id\": 'x' is also in row 1"
    ):
        do_import(tmp_path, interactions=log, items=items)
    items = write(tmp_path / "items.csv", {"item_id": ["x", "y"], "size": ["1", "big"]})
    with pytest.raises(
        DataFileError, match=r'items.csv: row 2, column "size": "big" is not a number'
    ):
        do_import(tmp_path, interactions=log, items=items, numeric=["size"])
    items = write(tmp_path / "items.csv", {"id": ["x", "y"]})
    with pytest.raises(
        DataFileError, match=r'items.csv: no column "item_id" \(set by --item-column\)'
    ):
        do_import(tmp_path, interactions=log, items=items)


def test_named_optional_columns_must_exist_and_out_must_be_ours(tmp_path: Path) -> None:
    log = write(tmp_path / "log.csv", GOOD)
    with pytest.raises(DataFileError, match='no column "score" \\(set by --weight-column\\)'):
        do_import(tmp_path, interactions=log, weight_column="score")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(DataFileError, match="is not a data set folder"):
        import_data(ImportConfig(interactions=log, out=other))
    with pytest.raises(ValueError, match=r"--items: .* is not a file"):
        do_import(tmp_path, interactions=log, items=tmp_path / "missing.csv")
