"""manifest.json: every file with size and SHA-256; verify names the first bad file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.repository.manifest import (
    MANIFEST_FILE,
    CorruptVersionError,
    list_files,
    read_manifest,
    verify,
    write_manifest,
)


@pytest.fixture
def version(tmp_path: Path) -> Path:
    d = tmp_path / "7"
    (d / "model").mkdir(parents=True)
    (d / "model.py").write_text("print('backend')\n")
    (d / "model" / "model.pt").write_bytes(bytes(range(256)) * 40)
    (d / "model" / "config.json").write_text("{}")
    write_manifest(d, model="demo", version=7)
    return d


def test_manifest_lists_every_file(version: Path) -> None:
    m = verify(version)
    assert (m.model, m.version) == ("demo", 7)
    assert [e.path for e in m.files] == ["model.py", "model/config.json", "model/model.pt"]
    assert {e.path: e.size for e in m.files}["model/model.pt"] == 256 * 40
    assert all(len(e.sha256) == 64 for e in m.files)
    assert m.created.endswith("Z") and m.recserve_version and m.torch_version


def test_flipped_byte_is_detected(version: Path) -> None:
    p = version / "model" / "model.pt"
    data = bytearray(p.read_bytes())
    data[1234] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptVersionError, match=r"model/model\.pt: sha256 mismatch"):
        verify(version)


def test_truncated_file_is_detected(version: Path) -> None:
    p = version / "model" / "model.pt"
    p.write_bytes(p.read_bytes()[:-1])
    with pytest.raises(CorruptVersionError, match=r"model/model\.pt: size 10239"):
        verify(version)


def test_missing_file_is_detected(version: Path) -> None:
    (version / "model" / "config.json").unlink()
    with pytest.raises(CorruptVersionError, match=r"model/config\.json: missing"):
        verify(version)


def test_extra_file_is_detected(version: Path) -> None:
    (version / "model" / "evil.pt").write_bytes(b"x")
    with pytest.raises(CorruptVersionError, match=r"model/evil\.pt: not in the manifest"):
        verify(version)


def test_pycache_is_neither_listed_nor_extra(version: Path) -> None:
    """Triton's stub imports model.py and may write __pycache__/ beside it."""
    (version / "__pycache__").mkdir()
    (version / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    verify(version)
    assert "__pycache__/model.cpython-311.pyc" not in list_files(version)


def test_missing_or_malformed_manifest(version: Path) -> None:
    path = version / MANIFEST_FILE
    text = path.read_text()
    path.write_text("{not json")
    with pytest.raises(CorruptVersionError, match=r"manifest\.json: not JSON"):
        verify(version)
    d = json.loads(text)
    del d["files"]
    path.write_text(json.dumps(d))
    with pytest.raises(CorruptVersionError, match="missing field 'files'"):
        verify(version)
    path.unlink()
    with pytest.raises(CorruptVersionError, match=r"manifest\.json: missing"):
        read_manifest(version)


@pytest.mark.parametrize("bad", ["../outside", "/etc/passwd", "model/../../x"])
def test_manifest_paths_stay_inside_the_version(version: Path, bad: str) -> None:
    path = version / MANIFEST_FILE
    d = json.loads(path.read_text())
    d["files"][0]["path"] = bad
    path.write_text(json.dumps(d))
    with pytest.raises(CorruptVersionError, match="leaves the version folder"):
        verify(version)
