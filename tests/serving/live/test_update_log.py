"""The update log's framing: records round-trip, a torn last write at any byte is dropped
without losing an earlier record, damage before the tail is refused, appends resume cleanly."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.live.update_log import (
    HEADER,
    CorruptLogError,
    UpdateLog,
    frame,
    log_path,
    parse_log,
    read_log,
)

payloads = st.lists(st.binary(min_size=1, max_size=300), min_size=0, max_size=8)


def write(path: Path, records: list[bytes]) -> None:
    log, existing = UpdateLog.open(path)
    assert existing == []
    for i, r in enumerate(records, start=1):
        assert log.append(r) == i
    log.close()


@settings(max_examples=60, deadline=None)
@given(records=payloads)
def test_records_round_trip(records):
    with tempfile.TemporaryDirectory() as d:
        path = log_path(Path(d), "demo", 3)
        write(path, records)
        log, replayed = UpdateLog.open(path)
        assert replayed == records and log.count == len(records)
        assert log.append(b"next") == len(records) + 1
        log.close()
        assert read_log(path).records == [*records, b"next"]


@settings(max_examples=120, deadline=None)
@given(records=payloads.filter(bool), data=st.data())
def test_a_torn_tail_at_any_byte_keeps_every_earlier_record(records, data):
    blob = b"".join(frame(r) for r in records)
    cut = data.draw(st.integers(0, len(blob)))
    ends = [sum(HEADER.size + len(r) for r in records[: i + 1]) for i in range(len(records))]
    kept = [r for r, end in zip(records, ends, strict=True) if end <= cut]
    contents = parse_log(blob[:cut])
    assert contents.records == kept
    assert contents.end == (ends[len(kept) - 1] if kept else 0)
    assert contents.torn == cut - contents.end
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "updates.log"
        path.write_bytes(blob[:cut])
        log, replayed = UpdateLog.open(path)
        assert replayed == kept
        assert path.stat().st_size == contents.end  # the torn bytes are cut away
        assert log.append(b"after the crash") == len(kept) + 1
        log.close()
        assert read_log(path).records == [*kept, b"after the crash"]


@settings(max_examples=60, deadline=None)
@given(records=payloads.filter(bool), data=st.data())
def test_a_flipped_byte_in_the_last_record_is_a_torn_tail(records, data):
    blob = bytearray(b"".join(frame(r) for r in records))
    last = len(blob) - len(records[-1])
    at = data.draw(st.integers(last, len(blob) - 1))
    blob[at] ^= 0xFF
    assert parse_log(bytes(blob)).records == records[:-1]


def test_zero_filled_tail_is_torn():
    blob = frame(b"a") + frame(b"bb") + b"\0" * 40
    contents = parse_log(blob)
    assert contents.records == [b"a", b"bb"] and contents.torn == 40


def test_damage_before_the_tail_is_refused():
    blob = bytearray(frame(b"first") + frame(b"second") + frame(b"third"))
    blob[HEADER.size + 1] ^= 0x01  # inside "first"'s payload
    with pytest.raises(CorruptLogError, match="record 1 at byte 0 is damaged"):
        parse_log(bytes(blob))


def test_empty_payloads_are_refused_and_a_missing_log_is_empty(tmp_path):
    with pytest.raises(ValueError, match="payload"):
        frame(b"")
    assert read_log(tmp_path / "nope" / "updates.log").records == []
    log, records = UpdateLog.open(log_path(tmp_path, "m", 1))
    assert records == [] and log.path == tmp_path / "m" / "1" / "updates.log"
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.append(b"x")


def test_a_failed_write_leaves_no_partial_frame(tmp_path, monkeypatch):
    import os

    import serving.live.update_log as module

    log, _ = UpdateLog.open(tmp_path / "updates.log")
    log.append(b"one")
    pwrite = os.pwrite

    def half_write(fd: int, data: bytes, offset: int) -> int:
        pwrite(fd, data[: len(data) // 2], offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module.os, "pwrite", half_write)
    with pytest.raises(OSError, match="No space"):
        log.append(b"two")
    monkeypatch.undo()
    assert log.append(b"three") == 2
    log.close()
    assert read_log(tmp_path / "updates.log").records == [b"one", b"three"]
