"""The update log of one served (model, version): append-only, fsync'd, replayed on load.

Layout: ``<state_dir>/<model>/<version>/updates.log``, a sequence of framed records::

    magic "RSU1" (4 bytes) | payload length n (uint32 LE) | crc32(length bytes + payload) (uint32 LE) | payload (n bytes)

Record ``s`` (1-based) is the update with sequence number ``s``. :meth:`UpdateLog.append` writes
one frame and ``fsync``s the file before it returns (and the folders it created, so the file's
name is durable too), so an acknowledged update survives ``kill -9`` or a power cut.

A crash in the middle of an append leaves a **torn tail**: a last frame whose header is
incomplete, whose payload runs past the end of the file, whose checksum fails, or bytes that are
all zeros (a file extended but never written). :func:`read_log` drops it (and
:meth:`UpdateLog.open` truncates it away) without losing any record before it. A bad frame
followed by more data is not a torn write but damage: :class:`CorruptLogError`, and nothing is
replayed. A newer full publish starts a new version, whose log starts empty.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from common.atomic import fsync_dir

log = logging.getLogger(__name__)

LOG_FILE = "updates.log"
MAGIC = b"RSU1"
HEADER = struct.Struct("<4sII")
"""magic, payload length, crc32 of (length bytes + payload)."""


class CorruptLogError(RuntimeError):
    """A damaged record before the end of an update log (not a torn last write)."""


def log_path(state_dir: Path, model: str, version: int) -> Path:
    """``state_dir/<model>/<version>/updates.log``."""
    return Path(state_dir) / model / str(int(version)) / LOG_FILE


def frame(payload: bytes) -> bytes:
    """One record as written: header + payload (``payload`` must not be empty)."""
    if not payload:
        raise ValueError("payload: an update record is never empty")
    length = struct.pack("<I", len(payload))
    return HEADER.pack(MAGIC, len(payload), zlib.crc32(length + payload)) + payload


@dataclass(frozen=True)
class LogContents:
    """What a log file holds: its good ``records`` (in order), the byte offset ``end`` where
    they end, and ``torn`` bytes after it (a torn last write, to be cut away)."""

    records: list[bytes]
    end: int
    torn: int


def parse_log(data: bytes, where: str = "update log") -> LogContents:
    """Splits ``data`` into records; raises :class:`CorruptLogError` for damage before the
    tail (see the module docstring)."""
    records: list[bytes] = []
    pos = 0
    while pos < len(data):
        payload = _record_at(data, pos)
        if payload is None:
            if _is_torn_tail(data, pos):
                return LogContents(records, pos, len(data) - pos)
            raise CorruptLogError(
                f"{where}: record {len(records) + 1} at byte {pos} is damaged and more data "
                f"follows it ({len(data) - pos} bytes): not a torn last write; nothing replayed"
            )
        records.append(payload)
        pos += HEADER.size + len(payload)
    return LogContents(records, pos, 0)


def _record_at(data: bytes, pos: int) -> bytes | None:
    """The payload of a complete, valid frame at ``pos``, else None."""
    if len(data) - pos < HEADER.size:
        return None
    magic, length, crc = HEADER.unpack_from(data, pos)
    start = pos + HEADER.size
    if magic != MAGIC or length == 0 or start + length > len(data):
        return None
    payload = data[start : start + length]
    return payload if zlib.crc32(data[pos + 4 : pos + 8] + payload) == crc else None


def _is_torn_tail(data: bytes, pos: int) -> bool:
    """Whether the bad frame at ``pos`` is the last write, cut short."""
    rest = len(data) - pos
    if rest < HEADER.size or not data[pos:].strip(b"\0"):
        return True  # header cut short, or a zero-filled tail
    magic, length, _ = HEADER.unpack_from(data, pos)
    return magic == MAGIC and pos + HEADER.size + length >= len(data)


def read_log(path: Path) -> LogContents:
    """The records of the log at ``path`` (none when it does not exist); reads only."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return LogContents([], 0, 0)
    return parse_log(data, str(path))


def _make_dirs(path: Path) -> None:
    """``mkdir -p`` that fsyncs the parent of every folder it creates."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)


class UpdateLog:
    """The open log of one (model, version). Thread-safe; ``append`` returns once durable.

    ``UpdateLog.open(path)`` returns the log and the records already in it (replay them first).
    """

    def __init__(self, path: Path, fd: int, end: int, count: int):
        self.path, self._fd, self._end, self._count = path, fd, end, count
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: Path) -> tuple[UpdateLog, list[bytes]]:
        """Opens (creating it durably) the log at ``path``; cuts a torn tail away (fsync'd).
        Returns the log and its records, oldest first."""
        _make_dirs(path.parent)
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if created:
                fsync_dir(path.parent)
            contents = parse_log(os.pread(fd, os.fstat(fd).st_size, 0), str(path))
            if contents.torn:
                log.warning(
                    "%s: dropping a torn last record (%d bytes after record %d)",
                    path,
                    contents.torn,
                    len(contents.records),
                )
                os.ftruncate(fd, contents.end)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, contents.end, len(contents.records)), contents.records

    @property
    def count(self) -> int:
        """Records in the log (the sequence number of the last one; 0 when empty)."""
        return self._count

    def append(self, payload: bytes) -> int:
        """Writes one record and fsyncs it; returns its sequence number. On a failed write the
        file is cut back to its previous end, so a later append never follows a partial frame."""
        data = frame(payload)
        with self._lock:
            if self._fd < 0:
                raise ValueError(f"{self.path}: the log is closed")
            try:
                written = os.pwrite(self._fd, data, self._end)
                if written != len(data):
                    raise OSError(f"{self.path}: short write ({written} of {len(data)} bytes)")
                os.fsync(self._fd)
            except BaseException:
                os.ftruncate(self._fd, self._end)
                raise
            self._end += len(data)
            self._count += 1
            return self._count

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
