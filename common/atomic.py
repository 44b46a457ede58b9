"""Atomic and durable file writes: the one home of "temp file, fsync, ``os.replace``, fsync the
folder".

The guarantee of the ``atomic_*`` functions: when one returns, ``path`` holds the whole new
content and keeps it across a crash or power loss; when one raises (or the process dies midway),
``path`` holds its old content (or still does not exist). A reader never sees half a file. That
takes four steps, each for a reason:

1. write a temp file beside ``path`` (same folder: same file system, so the rename is atomic),
   named ``.<name>.<32 hex>.tmp`` (hidden, and unique: concurrent writers never share one);
2. ``fsync`` it (else the rename can reach the disk before the data, and a power loss leaves an
   empty or torn file under the final name);
3. ``os.replace`` it onto ``path`` (one atomic step on POSIX);
4. ``fsync`` the folder (else the rename itself may be lost).

A failed write removes its temp file; only a killed writer leaves one, which
:func:`temp_target` recognises so that the next writer can remove it.

For files inside a staging folder that is itself published by one rename (a model version, an
embedding shard), an atomic write per file is not needed: :func:`write_synced` writes in place
and fsyncs, and :func:`fsync_tree` makes a whole folder durable before its rename.

Example::

    atomic_write_json(out / "manifest.json", {"done": {}})
    with atomic_writer(out / "model.pt") as fh:   # writers that stream into a file
        torch.save(state, fh)

Every step goes through ``open`` / ``os`` functions looked up at call time, so tests can inject
faults (a full disk, a read-only folder) by patching them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TEMP_SUFFIX = ".tmp"
_TEMP_NAME = re.compile(r"\.(?P<target>.+)\.[0-9a-f]{32}" + re.escape(TEMP_SUFFIX))


def fsync_dir(path: Path | str) -> None:
    """Makes a folder's entries (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    """Makes a file's content, written earlier (perhaps by another process), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path | str) -> None:
    """fsyncs every file and folder under ``directory``, children before parents (so that a
    folder renamed into place afterwards holds all of it after a power loss)."""
    for root, _dirs, files in os.walk(directory, topdown=False):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


def write_synced(path: Path | str, data: bytes | memoryview) -> None:
    """Writes ``data`` to ``path`` in place and fsyncs it. Not atomic: a crash can leave part of
    it, so use it only under a staging folder that is published whole by a rename."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def temp_path(path: Path) -> Path:
    """A fresh temp file name beside ``path``: ``.<name>.<32 hex>.tmp``."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}{TEMP_SUFFIX}")


def temp_target(name: str) -> str | None:
    """The file name that the temp file ``name`` (from :func:`temp_path`) was written for;
    None when ``name`` is not such a temp file."""
    m = _TEMP_NAME.fullmatch(name)
    return m.group("target") if m else None


@contextlib.contextmanager
def atomic_writer(
    path: Path | str, mode: str = "wb", *, encoding: str | None = None, newline: str | None = None
) -> Iterator[IO[Any]]:
    """An open temp file (``mode`` ``"wb"`` or ``"w"``) that replaces ``path`` atomically and
    durably when the ``with`` block ends without an exception (see the module docstring for the
    guarantee). An exception in the block, or in writing, syncing or renaming, removes the temp
    file, leaves ``path`` as it was and propagates."""
    if mode not in ("wb", "w"):
        raise ValueError(f"mode: must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, mode, encoding=encoding, newline=newline) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        # the cause is what the caller needs to see, not a failure to clean up after it
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path | str, data: bytes | memoryview) -> None:
    """Replaces ``path`` with ``data``, atomically and durably (see the module docstring)."""
    with atomic_writer(path, "wb") as fh:
        fh.write(data)


def atomic_write_text(path: Path | str, text: str, encoding: str = "utf-8") -> None:
    """Replaces ``path`` with ``text``, atomically and durably (see the module docstring)."""
    with atomic_writer(path, "w", encoding=encoding) as fh:
        fh.write(text)


def atomic_write_json(path: Path | str, obj: Any, indent: int | None = 2) -> None:
    """Replaces ``path`` with ``obj`` as JSON (UTF-8), atomically and durably. The JSON is
    encoded before the temp file is opened, so an object that cannot be encoded leaves no
    trace."""
    atomic_write_text(path, json.dumps(obj, indent=indent))
