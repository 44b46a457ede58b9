"""common.atomic: a file after an atomic write holds exactly what was written; a fault anywhere
between the first byte and the rename leaves the old content and no temp file; the data is
fsynced before the rename and the folder after it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import atomic
from common.atomic import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    atomic_writer,
    fsync_tree,
    temp_path,
    temp_target,
    write_synced,
)

TARGET = "out.bin"
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def streamed(path: Path, data: bytes) -> None:
    """What the torch.save / parquet sites do: several writes into the open temp file."""
    with atomic_writer(path) as fh:
        for i in range(0, len(data), 7):
            fh.write(data[i : i + 7])


WRITERS: dict[str, Callable[[Path, bytes], None]] = {
    "bytes": atomic_write_bytes,
    "text": lambda p, d: atomic_write_text(p, d.hex()),
    "json": lambda p, d: atomic_write_json(p, {"data": d.hex()}),
    "streamed": streamed,
}


def expected(kind: str, data: bytes) -> bytes:
    """The bytes ``WRITERS[kind]`` puts in the file for ``data``."""
    if kind == "text":
        return data.hex().encode()
    if kind == "json":
        return json.dumps({"data": data.hex()}, indent=2).encode()
    return data


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@fixture_ok
@given(
    kind=st.sampled_from(sorted(WRITERS)),
    contents=st.lists(st.binary(max_size=300), min_size=1, max_size=4),
)
def test_the_file_holds_what_was_last_written_and_nothing_else_is_left(
    tmp_path: Path, kind: str, contents: list[bytes]
) -> None:
    path = tmp_path / kind / TARGET
    path.parent.mkdir(exist_ok=True)
    for data in contents:
        WRITERS[kind](path, data)
        assert path.read_bytes() == expected(kind, data)
        assert names(path.parent) == [TARGET]


class Fault(OSError):
    pass


def fail(*_: Any, **__: Any) -> None:
    raise Fault(28, "injected")


@fixture_ok
@given(
    kind=st.sampled_from(sorted(WRITERS)),
    old=st.binary(max_size=200),
    new=st.binary(max_size=200),
    where=st.sampled_from(["fsync", "replace"]),
)
def test_a_fault_before_the_rename_leaves_the_old_content_and_no_temp_file(
    tmp_path: Path, kind: str, old: bytes, new: bytes, where: str
) -> None:
    path = tmp_path / kind / TARGET
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(old)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, where, fail)
        with pytest.raises(Fault):
            WRITERS[kind](path, new)
    assert path.read_bytes() == old
    assert names(path.parent) == [TARGET]


def test_an_error_in_the_writers_block_leaves_no_trace(tmp_path: Path) -> None:
    path = tmp_path / TARGET
    with pytest.raises(ZeroDivisionError), atomic_writer(path) as fh:
        fh.write(b"half")
        _ = 1 / 0
    assert names(tmp_path) == []


def test_a_failed_cleanup_does_not_hide_the_cause(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / TARGET
    monkeypatch.setattr(os, "replace", fail)
    monkeypatch.setattr(os, "unlink", lambda *a, **k: (_ for _ in ()).throw(PermissionError()))
    with pytest.raises(Fault):
        atomic_write_bytes(path, b"new")
    assert not path.exists()


def test_data_is_synced_before_the_rename_and_the_folder_after(tmp_path: Path, monkeypatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "sub" / TARGET
    path.parent.mkdir()
    atomic_write_bytes(path, b"data")
    assert len(events) == 3, events
    (k0, temp), (k1, dst), (k2, folder) = events
    assert (k0, k1, k2) == ("fsync", "replace", "fsync")
    assert temp_target(Path(temp).name) == TARGET and Path(temp).parent == path.parent
    assert dst == str(path) and folder == str(path.parent)


def test_fsync_dir_is_called_on_the_parent(tmp_path: Path, monkeypatch) -> None:
    synced: list[Path] = []
    monkeypatch.setattr(atomic, "fsync_dir", lambda p: synced.append(Path(p)))
    atomic_write_text(tmp_path / "b.txt", "x")
    assert synced == [tmp_path]


def test_temp_names_are_unique_hidden_and_recognised() -> None:
    path = Path("/x/config.pbtxt")
    a, b = temp_path(path), temp_path(path)
    assert a != b and a.parent == path.parent and a.name.startswith(".config.pbtxt.")
    assert temp_target(a.name) == "config.pbtxt" and a.name.endswith(".tmp")
    for other in ("config.pbtxt", ".config.pbtxt.tmp", "config.pbtxt.tmp", ".x.1234.tmp"):
        assert temp_target(other) is None, other


def test_only_whole_file_modes_are_accepted(tmp_path: Path) -> None:
    for mode in ("ab", "r+", "a"):
        with pytest.raises(ValueError, match="mode"), atomic_writer(tmp_path / TARGET, mode):
            pass
    assert names(tmp_path) == []


def test_fsync_tree_syncs_every_file_and_folder_children_first(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    write_synced(tmp_path / "a" / "b" / "f", b"1")
    write_synced(tmp_path / "a" / "g", memoryview(b"22"))
    assert (tmp_path / "a" / "g").read_bytes() == b"22"
    seen: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: (seen.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))
    )
    fsync_tree(tmp_path / "a")
    rel = [os.path.relpath(p, tmp_path) for p in seen]
    assert sorted(rel) == sorted(["a/b/f", "a/b", "a/g", "a"])
    assert rel.index("a/b/f") < rel.index("a/b") < rel.index("a") and rel.index("a/g") < rel.index(
        "a"
    )
