"""A model folder's mechanics besides the versions' content (see ``repository.py`` for the layout
and the publish protocol): version numbers, a version's own ``config.pbtxt``, the publish lock,
what killed publishes leave, retention.

The writers here run under the model's publish lock (:func:`locked`), held by the caller.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.atomic import fsync_dir, temp_target
from serving.repository.config import CONFIG_FILE, TritonConfig, parse_config, read_config
from serving.repository.manifest import MANIFEST_FILE, CorruptVersionError, read_manifest

LOCK_FILE = ".publish.lock"
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".deleted-"
STALE_STAGING_S = 3600.0
"""A staging folder older than this is a crashed publish; the next publish removes it (one
staged by a process of this host that no longer runs is removed at once)."""

_VERSION = re.compile(r"[1-9][0-9]*")


def numbered(mdir: Path) -> list[int]:
    """Every numbered folder, complete or not."""
    if not mdir.is_dir():
        return []
    return [int(p.name) for p in mdir.iterdir() if _VERSION.fullmatch(p.name) and p.is_dir()]


def complete_versions(mdir: Path) -> list[int]:
    """Numbered folders with a manifest, ascending."""
    return sorted(v for v in numbered(mdir) if (mdir / str(v) / MANIFEST_FILE).is_file())


def own_config(vdir: Path) -> bytes | None:
    """The bytes of a complete version's own ``config.pbtxt``, checked against its manifest
    entry (not the whole version: cheap enough for every load); None for a version published
    without one. :class:`CorruptVersionError` when they do not match."""
    path = vdir / CONFIG_FILE
    entry = next((f for f in read_manifest(vdir).files if f.path == CONFIG_FILE), None)
    if entry is None:
        if path.exists():
            raise CorruptVersionError(f"{vdir}: {CONFIG_FILE}: not in the manifest")
        return None
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorruptVersionError(f"{vdir}: {CONFIG_FILE}: missing") from None
    if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise CorruptVersionError(f"{vdir}: {CONFIG_FILE}: does not match the manifest")
    return data


def parse_own_config(data: bytes, path: Path) -> TritonConfig:
    """:func:`own_config`'s bytes -> ``ModelConfig``; ``ValueError`` naming ``path``."""
    try:
        return parse_config(data.decode("utf-8"), str(path))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def read_config_file(path: Path) -> TritonConfig:
    """:func:`read_config`, with a file that is no text refused naming it too."""
    try:
        return read_config(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


@contextmanager
def locked(path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (per open file, so threads of one process exclude
    each other too); yields whether it is held (``wait=False``: False when another holds it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def stage_name() -> str:
    """Names its publisher, so that the next publish can tell when that one is gone."""
    return f"{STAGING_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"


def _abandoned(stage: Path, now: float) -> bool:
    """A staging folder whose publisher is gone: staged by a process of this host that no longer
    runs, or older than :data:`STALE_STAGING_S` (another host's, or an unknown name)."""
    host_pid = stage.name[len(STAGING_PREFIX) :].rsplit("-", 2)[:-1]
    if len(host_pid) == 2 and host_pid[0] == socket.gethostname() and host_pid[1].isdigit():
        try:
            os.kill(int(host_pid[1]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it runs, as another user
    return now - stage.stat().st_mtime > STALE_STAGING_S


def remove_leftovers(mdir: Path) -> None:
    """Removes deleted versions not yet gone, staging folders of crashed publishes and the temp
    files of interrupted config writes (only publish writes the config, under the lock held)."""
    now = time.time()
    for p in mdir.iterdir():
        if p.name.startswith(TRASH_PREFIX) or (
            p.name.startswith(STAGING_PREFIX) and _abandoned(p, now)
        ):
            shutil.rmtree(p, ignore_errors=True)
        elif temp_target(p.name) == CONFIG_FILE:  # a publish's or a repair's, killed midway
            p.unlink(missing_ok=True)


def retain(mdir: Path, keep: int) -> None:
    """Removes all but the newest ``keep`` complete versions; each disappears in one rename."""
    for v in complete_versions(mdir)[:-keep]:
        trash = mdir / f"{TRASH_PREFIX}{v}-{uuid.uuid4().hex}"
        os.rename(mdir / str(v), trash)
        fsync_dir(mdir)
        shutil.rmtree(trash, ignore_errors=True)
