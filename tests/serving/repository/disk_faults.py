"""File-system faults for ``test_publish_faults.py``, injected by monkeypatching the calls a
publish writes through (no size-limited mount is available to the tests):

* :class:`DiskFull`: files written under a folder share a byte budget; the write that passes it
  writes what still fits, then raises ``ENOSPC``, as a full disk does.
* :class:`ReadOnly`: what a read-only folder refuses, as ``EACCES`` (a folder without write
  permission: its entries cannot be created, renamed or removed) or ``EROFS`` (a read-only file
  system: nothing under it can be written).

Python writes files through ``open`` / ``io.open`` (``pathlib``, ``shutil``, the manifest and
config writers, and ``torch.save`` when given an open file); folders through ``os.mkdir``.
``shutil.copyfile`` is made to copy with ``write`` instead of ``os.sendfile`` so it is seen.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

_WRITE_MODES = frozenset("wax+")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _path(p: Any, dir_fd: int | None = None) -> str | None:
    """An absolute, normalized path, or None for an fd."""
    if isinstance(p, int):
        return None
    p = os.fsdecode(p)
    if dir_fd is not None and not os.path.isabs(p):
        p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
    return os.path.abspath(p)


def _under(path: str | None, folder: str) -> bool:
    return path is not None and (path == folder or path.startswith(folder + os.sep))


class _Budgeted:
    """An open file whose writes draw from a :class:`DiskFull` budget."""

    def __init__(self, f: Any, disk: DiskFull, path: str, record: list[Any]):
        self._f, self._disk, self._path, self._record = f, disk, path, record

    def write(self, data: Any) -> int:
        return self._disk.charge(self._f, self._path, self._record, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _Budgeted:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


class DiskFull:
    """``budget`` bytes for every file written under ``folder`` together (None: unlimited, only
    counted). Once spent, creating a folder there fails with ``ENOSPC`` too.

    ``files``: ``[relative path, bytes asked]`` per file opened for writing, in order.
    """

    def __init__(self, folder: Path, budget: int | None):
        self.folder, self.budget = os.path.abspath(folder), budget
        self.used = 0
        self.files: list[list[Any]] = []
        self.hit: str | None = None
        """The file whose write hit the limit."""

    def charge(self, f: Any, path: str, record: list[Any], data: Any) -> int:
        """Writes ``data`` (str or bytes-like) to ``f`` if it fits; else what fits, then ENOSPC."""
        view: Any = data if isinstance(data, str) else memoryview(data).cast("B")
        size = len(data.encode()) if isinstance(data, str) else view.nbytes
        record[1] += size
        if self.budget is None or self.used + size <= self.budget:
            self.used += size
            return int(f.write(data))
        fits = self.budget - self.used
        if fits > 0:
            f.write(view[:fits])
            f.flush()
        self.used = self.budget
        self.hit = self._rel(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    def _rel(self, path: str) -> str:
        return os.path.relpath(path, self.folder)

    @property
    def spent(self) -> bool:
        return self.budget is not None and self.used >= self.budget

    def install(self, mp: pytest.MonkeyPatch) -> None:
        real_open, real_mkdir = builtins.open, os.mkdir

        def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = real_open(file, mode, *args, **kwargs)
            path = _path(file)
            if _WRITE_MODES & set(mode) and _under(path, self.folder):
                assert path is not None
                self.files.append([self._rel(path), 0])
                return _Budgeted(f, self, path, self.files[-1])
            return f

        def fake_mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
            p = _path(path, dir_fd)
            if self.spent and _under(p, self.folder) and p is not None and not os.path.lexists(p):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), p)
            real_mkdir(path, mode, dir_fd=dir_fd)

        mp.setattr(builtins, "open", fake_open)
        mp.setattr(io, "open", fake_open)
        mp.setattr(os, "mkdir", fake_mkdir)
        mp.setattr(shutil, "_USE_CP_SENDFILE", False)


class ReadOnly:
    """Refuses writes under ``folder`` with ``err``: ``EACCES`` refuses new, renamed or removed
    entries directly in ``folder`` (``chmod a-w folder``: files that exist stay writable);
    ``EROFS`` refuses every write anywhere under it (a read-only mount)."""

    def __init__(self, folder: Path, err: int):
        assert err in (errno.EACCES, errno.EROFS)
        self.folder, self.err = os.path.abspath(folder), err
        self.refused: list[str] = []

    def _refuses(self, path: str | None, creates: bool = True) -> bool:
        if self.err == errno.EROFS:
            hit = _under(path, self.folder)
        else:
            hit = path is not None and creates and os.path.dirname(path) == self.folder
        if hit:
            assert path is not None
            self.refused.append(os.path.relpath(path, self.folder))
        return hit

    def _raise(self, path: str | None) -> None:
        raise OSError(self.err, os.strerror(self.err), path)

    def install(self, mp: pytest.MonkeyPatch) -> None:
        real = {
            n: getattr(os, n) for n in ("open", "mkdir", "rename", "replace", "unlink", "rmdir")
        }
        real_open = builtins.open

        def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            p = _path(file)
            if _WRITE_MODES & set(mode) and self._refuses(
                p, p is not None and not os.path.exists(p)
            ):
                self._raise(p)
            return real_open(file, mode, *args, **kwargs)

        def fake_os_open(
            path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None
        ) -> int:
            p = _path(path, dir_fd)
            if flags & _WRITE_FLAGS and self._refuses(p, p is not None and not os.path.exists(p)):
                self._raise(p)
            return int(real["open"](path, flags, mode, dir_fd=dir_fd))

        def entry_op(name: str) -> Any:
            def op(*paths: Any, **kw: Any) -> Any:
                fds = (
                    kw.get("src_dir_fd", kw.get("dir_fd")),
                    kw.get("dst_dir_fd", kw.get("dir_fd")),
                )
                for p, fd in zip(paths, fds, strict=False):
                    if self._refuses(_path(p, fd)):
                        self._raise(_path(p, fd))
                return real[name](*paths, **kw)

            return op

        mp.setattr(builtins, "open", fake_open)
        mp.setattr(io, "open", fake_open)
        mp.setattr(os, "open", fake_os_open)
        for name in ("mkdir", "rename", "replace", "unlink", "rmdir"):
            mp.setattr(os, name, entry_op(name))
