"""Cheap imports: the modules a config check, a planner run or ``recserve --help`` need load no
torch (importing torch takes seconds and hundreds of MB). Each case runs in a fresh interpreter,
where ``sys.modules`` starts empty: inside pytest torch is always loaded already."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]

LIGHT_MODULES = [
    "serving.app.config",
    "retrieval.training.config",
    "sharded_tables.planner",
    "sharded_tables.placement",
    "sharded_tables.interface",
    "sharded_tables.remote.config",
    "common.config",
    "common.security",
    "loadtest.shape",
]

# `recserve --help` as the console script runs it (typer prints the help and exits)
CLI_HELP = """
import sys
sys.argv = ["recserve", "--help"]
from recserve.cli import main
try:
    main()
except SystemExit:
    pass
"""


def torch_loaded_by(code: str) -> bool:
    """Runs ``code`` in a fresh interpreter; -> whether it left torch in ``sys.modules``."""
    probe = f"{code}\nimport sys\nprint('torch loaded:', 'torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("torch loaded: "), done.stdout[-2000:]
    return last == "torch loaded: True"


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_module_loads_no_torch(module: str) -> None:
    assert not torch_loaded_by(f"import {module}"), f"`import {module}` loads torch"


def test_recserve_help_loads_no_torch() -> None:
    assert not torch_loaded_by(CLI_HELP), "`recserve --help` loads torch"


def test_the_probe_sees_torch_when_it_is_loaded() -> None:
    """The check can fail: a module that does load torch is reported."""
    assert torch_loaded_by("import sharded_tables.collection")
