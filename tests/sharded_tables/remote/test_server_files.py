"""Shard folders on disk: round trip, atomic write, verification, and the keyed put log."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharded_tables.quantize import pack_rows
from sharded_tables.remote.server_files import (
    KeyLog,
    ServerTable,
    encode_record,
    read_server_folder,
    replay_log,
    write_server_folder,
)
from sharded_tables.specs import DType, row_bytes


def ranged(name: str, dtype: DType, dim: int, lo: int, hi: int, seed: int = 0) -> ServerTable:
    w = torch.randn(hi - lo, dim, generator=torch.Generator().manual_seed(seed))
    return ServerTable(name, dtype, dim, "range", lo, hi, pack_rows(w, dtype))


def test_round_trip_and_manifest(tmp_path: Path):
    keys = torch.tensor([9, -4, 1 << 62])
    keyed = ServerTable(
        "users", DType.FP16, 8, "keyed", rows=pack_rows(torch.randn(3, 8), "fp16"), ids=keys
    )
    tables = [ranged("items", DType.INT8, 16, 100, 400), keyed]
    write_server_folder(tmp_path / "shard", tables)

    manifest = json.loads((tmp_path / "shard" / "manifest.json").read_text())
    entry = manifest["tables"][0]
    assert (entry["partition"], entry["lo"], entry["hi"], entry["bytes"]) == (
        "range",
        100,
        400,
        300 * 20,
    )
    assert len(entry["sha256"]) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard"]  # no temporary folder left

    items, users = read_server_folder(tmp_path / "shard")
    assert torch.equal(items.rows, tables[0].rows) and (items.lo, items.hi) == (100, 400)
    order = torch.argsort(users.ids)
    assert torch.equal(users.ids[order], keys.sort().values)
    assert torch.equal(users.rows[order], keyed.rows[torch.argsort(keys)])


def test_existing_folder_is_refused(tmp_path: Path):
    (tmp_path / "shard").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        write_server_folder(tmp_path / "shard", [ranged("items", DType.FP32, 4, 0, 10)])


def test_failed_write_leaves_no_folder(tmp_path: Path):
    dup = [ranged("items", DType.FP32, 4, 0, 10), ranged("items", DType.FP32, 4, 10, 20)]
    with pytest.raises(ValueError, match="duplicate"):
        write_server_folder(tmp_path / "shard", dup)
    assert list(tmp_path.iterdir()) == []


def test_size_and_checksum_are_verified(tmp_path: Path):
    write_server_folder(tmp_path / "shard", [ranged("items", DType.INT8, 16, 0, 50)])
    data = tmp_path / "shard" / "items.bin"
    raw = bytearray(data.read_bytes())
    raw[7] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"items.*sha256"):
        read_server_folder(tmp_path / "shard")
    assert len(read_server_folder(tmp_path / "shard", verify=False)) == 1  # sizes still checked
    data.write_bytes(bytes(raw[:-1]))
    with pytest.raises(ValueError, match=r"items.*999 bytes, manifest says 1000"):
        read_server_folder(tmp_path / "shard", verify=False)


def test_bad_table_fields_are_named():
    with pytest.raises(ValueError, match="table 'items': rows must be uint8 \\[10, 20\\]"):
        ServerTable("items", DType.INT8, 16, "range", 0, 10, torch.zeros(9, 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match="table name 'a/b'"):
        ServerTable("a/b", DType.INT8, 16, "keyed")
    with pytest.raises(ValueError, match="partition"):
        ServerTable("items", DType.INT8, 16, "hashed")  # type: ignore[arg-type]


def test_torn_last_record_is_ignored_and_cut_before_appending(tmp_path: Path):
    rb = row_bytes(4, DType.FP32)
    log = tmp_path / "t.keys.log"
    first = np.full((2, rb), 1, np.uint8)
    log.write_bytes(
        encode_record(np.array([1, 2]), first) + encode_record(np.array([3]), first[:1])[:-5]
    )
    keys, rows, valid = replay_log(log, rb)
    assert keys.tolist() == [1, 2] and valid == len(encode_record(np.array([1, 2]), first))

    appender = KeyLog(log, valid)
    appender.append(np.array([2]), np.full((1, rb), 7, np.uint8))
    appender.close()
    keys, rows, _ = replay_log(log, rb)
    assert keys.tolist() == [1, 2] and rows[:, 0].tolist() == [1, 7]


def test_corrupt_record_in_the_middle_raises(tmp_path: Path):
    rb = row_bytes(4, DType.FP32)
    rec = bytearray(encode_record(np.array([1]), np.zeros((1, rb), np.uint8)))
    rec[-1] ^= 1
    (tmp_path / "t.keys.log").write_bytes(
        bytes(rec) + encode_record(np.array([2]), np.zeros((1, rb), np.uint8))
    )
    with pytest.raises(ValueError, match="corrupt record at byte 0"):
        replay_log(tmp_path / "t.keys.log", rb)


table_st = st.tuples(
    st.sampled_from(list(DType)),
    st.sampled_from([2, 4, 6]),
    st.integers(0, 1000),  # lo
    st.integers(0, 40),  # rows
)


@settings(max_examples=25, deadline=None)
@given(st.lists(table_st, min_size=1, max_size=3), st.integers(0, 2**31))
def test_shard_round_trip_property(specs, seed):
    tables = [
        ranged(f"t{i}", dt, dim, lo, lo + n, seed + i) for i, (dt, dim, lo, n) in enumerate(specs)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        write_server_folder(Path(tmp) / "s", tables)
        back = read_server_folder(Path(tmp) / "s")
    for a, b in zip(tables, back, strict=True):
        assert (a.name, a.dtype, a.dim, a.lo, a.hi) == (b.name, b.dtype, b.dim, b.lo, b.hi)
        assert torch.equal(a.rows, b.rows)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 5), max_size=6), max_size=6
    ),
    st.data(),
)
def test_log_replay_equals_last_write_and_any_cut_keeps_whole_records(puts, data):
    rb = row_bytes(2, DType.FP8)
    blobs, model, models = [], {}, [{}]
    for i, keys in enumerate(puts):
        rows = np.full((len(keys), rb), i, np.uint8)
        blobs.append(encode_record(np.array(keys, dtype=np.int64), rows))
        model.update(dict.fromkeys(keys, i))
        models.append(dict(model))
    whole = b"".join(blobs)
    cut = data.draw(st.integers(0, len(whole)))
    kept = sum(1 for end in np.cumsum([len(b) for b in blobs]) if end <= cut)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.keys.log"
        path.write_bytes(whole[:cut])
        keys, rows, valid = replay_log(path, rb)
    assert dict(zip(keys.tolist(), rows[:, 0].tolist(), strict=True)) == models[kept]
    assert valid == sum(len(b) for b in blobs[:kept])
