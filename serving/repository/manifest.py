"""``manifest.json``: what a published version holds, with sizes and SHA-256 checksums.

Every file under the version folder (relative POSIX path, size in bytes, sha256) is listed, plus
the model name, the version number, when it was written and the recserve / torch versions that
wrote it. A version whose files do not match is refused (:class:`CorruptVersionError`)::

    write_manifest(stage, model="demo", version=3)   # after every other file is written
    verify(repo / "demo" / "3")                      # raises naming the first bad file

``__pycache__`` folders are neither listed nor counted as extra: the Python backend's import of
``model.py`` may write one beside it. A version holds plain files and folders only: a symlink
could make a verified version load unverified bytes from anywhere, so it is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import common
from common.atomic import write_synced

MANIFEST_FILE = "manifest.json"
FORMAT = 1
IGNORED_DIRS = frozenset({"__pycache__"})
_CHUNK = 1 << 20


class CorruptVersionError(ValueError):
    """A version folder whose files do not match its manifest (or that has no valid manifest)."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a version."""

    path: str
    """Relative to the version folder, ``/``-separated."""
    size: int
    sha256: str


@dataclass
class Manifest:
    """The content of ``manifest.json``."""

    model: str
    version: int
    files: list[FileEntry]
    created: str = ""
    """UTC time of writing, ISO 8601."""
    recserve_version: str = common.__version__
    torch_version: str = torch.__version__
    format: int = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form facts about the version (e.g. the config overrides of the publish)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        """Parses ``text``; ``CorruptVersionError`` naming ``source`` and the field."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CorruptVersionError(f"{source}: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise CorruptVersionError(f"{source}: expected an object")
        if d.get("format") != FORMAT:
            raise CorruptVersionError(
                f"{source}: format: expected {FORMAT}, got {d.get('format')!r}"
            )
        try:
            files = [
                FileEntry(str(f["path"]), int(f["size"]), str(f["sha256"])) for f in d["files"]
            ]
            for f in files:
                parts = Path(f.path).parts
                if not parts or Path(f.path).is_absolute() or ".." in parts:
                    raise ValueError(f"files: path {f.path!r} leaves the version folder")
            return cls(
                model=str(d["model"]),
                version=int(d["version"]),
                files=files,
                created=str(d.get("created", "")),
                recserve_version=str(d.get("recserve_version", "")),
                torch_version=str(d.get("torch_version", "")),
                extra=dict(d.get("extra", {})),
            )
        except KeyError as e:
            raise CorruptVersionError(f"{source}: missing field {e}") from None
        except (TypeError, ValueError) as e:
            raise CorruptVersionError(f"{source}: malformed: {e}") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def list_files(directory: Path) -> list[str]:
    """Relative paths of the files under ``directory`` (sorted; manifest and caches excluded)."""
    out: list[str] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS)
        rel_root = Path(root).relative_to(directory)
        for f in files:
            rel = (rel_root / f).as_posix()
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def write_manifest(
    directory: Path, *, model: str, version: int, extra: dict[str, Any] | None = None
) -> Manifest:
    """Checksums every file under ``directory`` and writes ``manifest.json`` there (fsynced)."""
    entries = [
        FileEntry(rel, (directory / rel).stat().st_size, sha256_file(directory / rel))
        for rel in list_files(directory)
    ]
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    m = Manifest(model, version, entries, created=created, extra=dict(extra or {}))
    # in place, not atomic: the manifest is the last file of a staging folder that is published
    # whole by one rename (and a version without it is not complete)
    write_synced(directory / MANIFEST_FILE, m.to_json().encode("utf-8"))
    return m


def _refuse_links(directory: Path) -> None:
    """``CorruptVersionError`` naming the first symlink under ``directory`` (which may be one)."""
    for root, dirs, files in os.walk(directory):
        for name in sorted(dirs + files):
            p = Path(root) / name
            if p.is_symlink():
                rel = p.relative_to(directory).as_posix()
                raise CorruptVersionError(f"{directory}: {rel}: a symlink (versions hold files)")
        dirs[:] = [d for d in dirs if d not in IGNORED_DIRS]


def read_manifest(directory: Path) -> Manifest:
    """``manifest.json`` of a version; ``CorruptVersionError`` when missing or malformed."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise CorruptVersionError(f"{path}: missing")
    return Manifest.from_json(path.read_text(encoding="utf-8"), str(path))


def verify(directory: Path) -> Manifest:
    """Checks every file against the manifest; raises :class:`CorruptVersionError` naming the
    first missing, resized, altered, unlisted or symlinked file. Returns the manifest when all
    match."""
    _refuse_links(directory)
    m = read_manifest(directory)
    listed = {e.path for e in m.files}
    for e in m.files:
        p = directory / e.path
        if not p.is_file():
            raise CorruptVersionError(f"{directory}: {e.path}: missing")
        size = p.stat().st_size
        if size != e.size:
            raise CorruptVersionError(f"{directory}: {e.path}: size {size}, manifest says {e.size}")
        if sha256_file(p) != e.sha256:
            raise CorruptVersionError(f"{directory}: {e.path}: sha256 mismatch")
    for rel in list_files(directory):
        if rel not in listed:
            raise CorruptVersionError(f"{directory}: {rel}: not in the manifest")
    return m
