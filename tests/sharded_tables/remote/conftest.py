"""Real embedding-server processes on 127.0.0.1 for the remote-tier tests, always cleaned up."""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

STARTUP_S = 30.0


@dataclass
class ServerProc:
    """One ``recserve serve embeddings`` process and the address it printed."""

    proc: subprocess.Popen[str]
    address: str
    stderr: Path

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


def _first_line(proc: subprocess.Popen[str], stderr: Path, timeout: float) -> str:
    """The server's first stdout line, or a failure with its stderr (never blocks forever)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"embed-server printed nothing in {timeout} s: {stderr.read_text()}")
    line = proc.stdout.readline()
    if not line:
        proc.wait(5)
        raise RuntimeError(f"embed-server exited ({proc.returncode}): {stderr.read_text()}")
    return line


def embed_server_cmd(shard: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "recserve", "serve", "embeddings", "--folder", str(shard), *args]


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGCONT (it may be stopped), SIGTERM, then SIGKILL after 5 s."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()


class ServerLauncher:
    """Starts ``recserve serve embeddings`` processes and stops every one of them in :meth:`close`."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *shards: tuple[Path, int]) -> list[ServerProc]:
        """Starts one server per ``(shard folder, port)`` in parallel; waits until each serves."""
        pending = []
        for shard, port in shards:
            err = self.logs / f"server-{len(self.procs)}.stderr"
            with open(err, "w") as f:
                proc = subprocess.Popen(
                    embed_server_cmd(shard, "--grpc-port", str(port)),
                    stdout=subprocess.PIPE,
                    stderr=f,
                    text=True,
                )
            self.procs.append(proc)
            pending.append((proc, err))
        out = []
        for proc, err in pending:
            line = _first_line(proc, err, STARTUP_S)
            match = re.search(r"listening on (\S+)", line)
            assert match, line
            out.append(ServerProc(proc, match.group(1), err))
        return out

    def close(self) -> None:
        for proc in self.procs:
            stop(proc)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[ServerLauncher]:
    launcher = ServerLauncher(tmp_path)
    yield launcher
    launcher.close()


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerLauncher]:
    launcher = ServerLauncher(tmp_path_factory.mktemp("server-logs"))
    yield launcher
    launcher.close()


@pytest.fixture
def dead_address() -> str:
    """An address where nothing listens (a port just bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
