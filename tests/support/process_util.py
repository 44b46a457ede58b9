"""Starting and stopping real server processes in tests (``tests/`` is on the path via its
conftest: ``from process_util import first_line, stop``)."""

from __future__ import annotations

import selectors
import subprocess
from pathlib import Path

STARTUP_S = 90.0
WAIT = 10.0


def first_line(proc: subprocess.Popen[str], stderr: Path) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(STARTUP_S):
            raise TimeoutError(f"serve printed nothing in {STARTUP_S} s: {stderr.read_text()}")
    line = proc.stdout.readline()
    if not line:
        proc.wait(WAIT)
        raise RuntimeError(f"serve exited ({proc.returncode}): {stderr.read_text()}")
    return line.strip()


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(WAIT)
    if proc.stdout is not None:
        proc.stdout.close()
