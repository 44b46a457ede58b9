"""Real server processes in tests, through the one launcher (``common/process.py``): the
command lines in one place, started with their output in a log under the test's folder::

    with start_server(serve_cmd("--model-repo", repo, "--grpc-port", "0"), tmp_path) as proc:
        ready = proc.wait_ready(STARTUP_S)   # common/ready.py's ReadyLine
"""

from __future__ import annotations

import sys
from pathlib import Path

from common.process import Proc, start

STARTUP_S = 90.0
"""A server loads, warms and maybe builds its kernels before it is ready: slow on 2 cores."""


def recserve_cmd(*args: str | Path) -> list[str]:
    """``recserve ARGS`` with this interpreter (no installed script needed)."""
    return [sys.executable, "-m", "recserve", *map(str, args)]


def serve_cmd(*args: str | Path) -> list[str]:
    """``recserve serve model ARGS``: a model server."""
    return recserve_cmd("serve", "model", *args)


def embed_server_cmd(folder: Path, port: int, *args: str | Path) -> list[str]:
    """``recserve serve embeddings``: an embedding server of the rows in ``folder``."""
    return recserve_cmd("serve", "embeddings", "--folder", folder, "--grpc-port", str(port), *args)


def start_server(cmd: list[str], folder: Path, name: str = "server") -> Proc:
    """Starts ``cmd`` with its stdout and stderr in ``folder/NAME.log`` (``proc.log_path``)."""
    return start(cmd, log_path=folder / f"{name}.log", name=name)
