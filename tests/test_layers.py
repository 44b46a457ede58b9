"""The layer check (``make lint``'s ``lint-imports``, contracts in pyproject.toml) passes on the
tree, and fails on a copy of it with one back-import injected, naming that import: the check is
shown to catch what it is there for.

The copy holds the ``*.py`` files of the six packages and pyproject.toml under ``tmp_path``;
``lint-imports`` runs there with ``PYTHONPATH=tmp_path`` so grimp reads the copy, not the tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("recserve", "loadtest", "serving", "retrieval", "sharded_tables", "common")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(where: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the packages found first on ``PYTHONPATH=where``."""
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-logo", "--cache-dir", str(cache)],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def copy_tree(dest: Path) -> Path:
    """The packages' ``*.py`` files and pyproject.toml under ``dest``, layout preserved."""
    for package in PACKAGES:
        for src in (ROOT / package).rglob("*.py"):
            target = dest / src.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)
    shutil.copyfile(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def inject(tree: Path, module: str, line: str) -> None:
    """Appends ``line`` (an import) to ``module``'s file in ``tree``."""
    path = tree / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_tree_keeps_its_layers(tmp_path: Path) -> None:
    done = lint_imports(ROOT, tmp_path / "cache")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "back_import", "contract"),
    [
        # the bottom package importing the top of serving
        ("common.config", "import serving.types", "Packages: recserve -> loadtest"),
        # inside serving: the engine importing the process wiring above it
        ("serving.engine.state", "import serving.app.config", "serving: app -> front ends"),
    ],
)
def test_a_back_import_breaks_the_check_and_is_named(
    tmp_path: Path, module: str, back_import: str, contract: str
) -> None:
    tree = copy_tree(tmp_path / "tree")
    clean = lint_imports(tree, tmp_path / "cache")
    assert clean.returncode == 0, clean.stdout[-4000:] + clean.stderr[-2000:]
    inject(tree, module, back_import)
    done = lint_imports(tree, tmp_path / "cache")
    assert done.returncode != 0, done.stdout[-4000:]
    imported = back_import.removeprefix("import ")
    assert f"{contract}" in done.stdout and "BROKEN" in done.stdout, done.stdout[-4000:]
    # the report names the offending import: "<importer> -> <imported> (l.<line>)"
    assert f"{module} -> {imported}" in done.stdout, done.stdout[-4000:]
