"""One embedding server's folder on disk: packed rows and a manifest.

Layout::

    server-0/
      manifest.json          format, and per table: name, dtype, dim, partition, files
      item.bin               ranged table: (hi - lo) packed rows, raw bytes, row-major
      user_hash.keys.log     keyed table: append-only log of puts (see below)

* A **ranged** table holds the global rows ``[lo, hi)`` of a table; its ``.bin`` file is
  ``(hi - lo) * row_bytes(dim, dtype)`` bytes and the manifest records its size and sha256.
* A **keyed** table holds rows under raw 64-bit keys. Its log is a sequence of records
  ``u32 payload_bytes | u32 crc32(payload) | payload`` with payload
  ``u32 n | n int64 keys (little-endian) | n packed rows``; replaying the records in order (last
  write wins) gives the table. Each append is fsynced before the server acknowledges the put. A
  torn last record (a crash mid-append) is ignored and cut off before the next append.

:func:`write_server_folder` is atomic: files go to a temporary sibling folder, are fsynced, and the folder
is renamed into place, so a crash never leaves half a folder under the final name.

Example::

    rows = pack_rows(torch.randn(1000, 16), DType.INT8)  # [1000, 20] uint8
    write_server_folder(path, [ServerTable("item", DType.INT8, 16, "range", lo=0, hi=1000, rows=rows),
                       ServerTable("user", DType.FP16, 16, "keyed")])
    manifest, tables = read_server_folder(path)
    tables[0].rows.shape  # (1000, 20)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from common.atomic import fsync_dir, write_synced
from sharded_tables.specs import DType, row_bytes

FORMAT = "recserve-embedding-shard/1"
MANIFEST = "manifest.json"
Partition = Literal["range", "keyed"]
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_HEADER = struct.Struct("<II")  # payload bytes, crc32
_COUNT = struct.Struct("<I")


@dataclass
class ServerTable:
    """One table of an embedding server's folder.

    ``rows`` is ``uint8 [hi - lo, row_bytes(dim, dtype)]`` for a ranged table; for a keyed table
    it is ``uint8 [k, row_bytes]`` stored under ``ids int64 [k]``. ``rows`` may be left ``None``
    only where there are no rows (``lo == hi``, or a keyed table without ``ids``).
    """

    name: str
    dtype: DType
    dim: int
    partition: Partition
    lo: int = 0
    hi: int = 0
    rows: torch.Tensor | None = None
    ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.dtype = DType(self.dtype)
        rb = check_table(self.name, self.dtype, self.dim, self.partition, self.lo, self.hi)
        if self.partition == "range":
            expect = (self.hi - self.lo, rb)
        else:
            if self.ids is not None and (self.ids.dtype != torch.int64 or self.ids.dim() != 1):
                raise ValueError(
                    f"table {self.name!r}: ids must be int64 [k], got {self.ids.dtype}"
                )
            expect = (0 if self.ids is None else len(self.ids), rb)
        if self.rows is None and expect[0] == 0:
            self.rows = torch.zeros(expect, dtype=torch.uint8)
        if self.rows is None or self.rows.dtype != torch.uint8 or tuple(self.rows.shape) != expect:
            got = "None" if self.rows is None else f"{self.rows.dtype} {list(self.rows.shape)}"
            raise ValueError(f"table {self.name!r}: rows must be uint8 {list(expect)}, got {got}")

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.dim, self.dtype)

    def bin_file(self) -> str:
        return f"{self.name}.bin" if self.partition == "range" else f"{self.name}.keys.log"


def check_table(name: str, dtype: DType, dim: int, partition: str, lo: int, hi: int) -> int:
    """Validates a table's fields (errors name the table and field); returns its row bytes."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"table name {name!r}: use letters, digits, '_', '.', '-'")
    try:
        rb = row_bytes(dim, DType(dtype))
    except ValueError as e:
        raise ValueError(f"table {name!r}: {e}") from None
    if partition not in ("range", "keyed"):
        raise ValueError(f"table {name!r}: partition must be 'range' or 'keyed', got {partition!r}")
    if partition == "range" and not 0 <= lo <= hi:
        raise ValueError(f"table {name!r}: need 0 <= lo <= hi, got [{lo}, {hi})")
    return rb


def _write_file(path: Path, data: bytes | memoryview) -> str:
    """Writes and fsyncs ``data`` (in the temp folder that :func:`write_server_folder` renames into
    place); returns its sha256 hex digest."""
    write_synced(path, data)
    return hashlib.sha256(data).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def encode_record(ids: np.ndarray, rows: np.ndarray) -> bytes:
    """One log record for ``ids int64 [n]`` and ``rows uint8 [n, row_bytes]``."""
    payload = (
        _COUNT.pack(len(ids))
        + np.ascontiguousarray(ids, dtype="<i8").tobytes()
        + np.ascontiguousarray(rows, dtype=np.uint8).tobytes()
    )
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def replay_log(path: Path, rb: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Replays a keys log -> (keys int64 [k], rows uint8 [k, rb], bytes of whole records).

    Later records win over earlier ones. A torn or corrupt last record is ignored; a corrupt
    record followed by more data raises ``ValueError`` naming the file and offset.
    """
    return replay_records(path.read_bytes() if path.exists() else b"", rb, str(path))


def replay_records(data: bytes, rb: int, source: str) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`replay_log` on the log's bytes ``data`` (``source`` names them in errors)."""
    keys: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    off = 0
    while off + _HEADER.size <= len(data):
        size, crc = _HEADER.unpack_from(data, off)
        end = off + _HEADER.size + size
        payload = data[off + _HEADER.size : end]
        if end > len(data) or zlib.crc32(payload) != crc:
            if end < len(data):
                raise ValueError(f"{source}: corrupt record at byte {off} (crc or length)")
            break
        (n,) = _COUNT.unpack_from(payload)
        if size != _COUNT.size + n * (8 + rb):
            raise ValueError(
                f"{source}: record at byte {off} has {size} bytes, not {n} rows of {rb}"
            )
        keys.append(np.frombuffer(payload, "<i8", n, _COUNT.size))
        rows.append(np.frombuffer(payload, np.uint8, n * rb, _COUNT.size + 8 * n).reshape(n, rb))
        off = end
    if not keys:
        return np.zeros(0, np.int64), np.zeros((0, rb), np.uint8), off
    all_keys, all_rows = np.concatenate(keys), np.concatenate(rows)
    last = latest_positions(all_keys)
    return all_keys[last].astype(np.int64), all_rows[last], off


def latest_positions(keys: np.ndarray) -> np.ndarray:
    """Positions of the last occurrence of each distinct key in ``keys [n]`` (sorted by key)."""
    _, first_in_reversed = np.unique(keys[::-1], return_index=True)
    return len(keys) - 1 - first_in_reversed


class KeyLog:
    """Append side of a keyed table's log: each :meth:`append` is durable when it returns."""

    def __init__(self, path: Path, valid_bytes: int):
        self.path = path
        self._f = open(path, "ab")  # noqa: SIM115 (held open for the server's lifetime)
        self.size = self._f.tell()
        """Bytes of whole records (a mark :meth:`cut` can return to)."""
        if self.size != valid_bytes:  # cut off a torn tail before appending after it
            self.cut(valid_bytes)

    def append(self, ids: np.ndarray, rows: np.ndarray) -> None:
        record = encode_record(ids, rows)
        self._f.write(record)
        self._f.flush()
        os.fsync(self._f.fileno())
        self.size += len(record)

    def read(self, nbytes: int) -> bytes:
        """The log's first ``nbytes`` bytes."""
        with open(self.path, "rb") as f:
            return f.read(nbytes)

    def cut(self, nbytes: int) -> None:
        """Truncates the log to its first ``nbytes`` bytes, durably."""
        self._f.truncate(nbytes)
        self._f.seek(nbytes)
        os.fsync(self._f.fileno())
        self.size = nbytes

    def close(self) -> None:
        self._f.close()


def write_server_folder(folder: Path | str, tables: list[ServerTable]) -> dict[str, Any]:
    """Writes ``tables`` as the server folder ``folder`` (which must not exist) atomically.

    Returns the manifest written.
    """
    folder = Path(folder)
    if folder.exists():
        raise FileExistsError(f"server folder {folder} already exists")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"tables: duplicate names in {names}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        entries = []
        for t in tables:
            entry: dict[str, Any] = {
                "name": t.name,
                "dtype": t.dtype.value,
                "dim": t.dim,
                "row_bytes": t.row_bytes,
                "partition": t.partition,
                "file": t.bin_file(),
            }
            assert t.rows is not None  # set by __post_init__
            rows = t.rows.numpy()
            if t.partition == "range":
                data = np.ascontiguousarray(rows).data
                entry |= {"lo": t.lo, "hi": t.hi, "bytes": data.nbytes}
                entry["sha256"] = _write_file(tmp / entry["file"], data)
            else:
                ids = np.zeros(0, np.int64) if t.ids is None else t.ids.numpy()
                _write_file(tmp / entry["file"], encode_record(ids, rows) if len(ids) else b"")
            entries.append(entry)
        manifest = {"format": FORMAT, "tables": entries}
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
        fsync_dir(tmp)
        os.rename(tmp, folder)
        fsync_dir(folder.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def read_manifest(folder: Path | str) -> dict[str, Any]:
    """Loads and validates ``folder/manifest.json`` (no row data is read)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no embedding-server manifest")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format must be {FORMAT!r}, got {manifest.get('format')!r}")
    for e in manifest.get("tables", []):
        required = ["name", "dtype", "dim", "row_bytes", "partition", "file"]
        required += ["lo", "hi", "bytes", "sha256"] if e.get("partition") == "range" else []
        missing = [k for k in required if k not in e]
        if missing:
            raise ValueError(f"{path}: table {e.get('name')!r} lacks fields {missing}")
        rb = check_table(
            e["name"], e["dtype"], e["dim"], e["partition"], e.get("lo", 0), e.get("hi", 0)
        )
        if e["row_bytes"] != rb:
            raise ValueError(
                f"{path}: table {e['name']!r}: row_bytes is {e['row_bytes']}, not {rb}"
            )
    return manifest


def read_table(folder: Path | str, entry: dict[str, Any], verify: bool = True) -> ServerTable:
    """Loads one manifest entry, checking the file's size (and sha256 when ``verify``)."""
    folder = Path(folder)
    path = folder / entry["file"]
    name, rb = entry["name"], entry["row_bytes"]
    if entry["partition"] == "keyed":
        keys, rows, _ = replay_log(path, rb)
        return ServerTable(
            name, entry["dtype"], entry["dim"], "keyed",
            rows=torch.from_numpy(rows.copy()), ids=torch.from_numpy(keys),
        )  # fmt: skip
    size = path.stat().st_size if path.exists() else -1
    if size != entry["bytes"]:
        raise ValueError(
            f"{path}: table {name!r} file has {size} bytes, manifest says {entry['bytes']}"
        )
    if verify and _sha256(path) != entry["sha256"]:
        raise ValueError(f"{path}: table {name!r} sha256 does not match the manifest")
    rows = np.fromfile(path, dtype=np.uint8).reshape(entry["hi"] - entry["lo"], rb)
    return ServerTable(
        name,
        entry["dtype"],
        entry["dim"],
        "range",
        entry["lo"],
        entry["hi"],
        torch.from_numpy(rows),
    )


def read_server_folder(
    folder: Path | str, verify: bool = True, tables: list[str] | None = None
) -> list[ServerTable]:
    """Loads the server folder (``tables``: only these names); see :func:`read_table`."""
    manifest = read_manifest(folder)
    entries = select_tables(manifest, tables)
    return [read_table(folder, e, verify) for e in entries]


def select_tables(manifest: dict[str, Any], tables: list[str] | None) -> list[dict[str, Any]]:
    """Manifest entries named in ``tables`` (all when ``None``); unknown names raise."""
    entries = manifest["tables"]
    if tables is None:
        return list(entries)
    known = {e["name"]: e for e in entries}
    missing = [t for t in tables if t not in known]
    if missing:
        raise ValueError(f"tables: {missing} not in the server folder (it holds {sorted(known)})")
    return [known[t] for t in tables]
