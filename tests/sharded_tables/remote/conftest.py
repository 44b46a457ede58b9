"""Real embedding-server processes on 127.0.0.1 for the remote-tier tests, always cleaned up."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.process import Proc, stop_all
from support.process_util import embed_server_cmd, start_server

STARTUP_S = 30.0


@dataclass
class ServerProc:
    """One ``recserve serve embeddings`` process and the address its ready line named."""

    proc: subprocess.Popen[bytes]
    address: str
    stderr: Path
    """Its log (stdout and stderr)."""

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


class ServerLauncher:
    """Starts ``recserve serve embeddings`` processes and stops every one of them in :meth:`close`."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: list[Proc] = []

    def start(self, *shards: tuple[Path, int]) -> list[ServerProc]:
        """Starts one server per ``(server folder, port)`` in parallel; waits until each serves."""
        pending = []
        for shard, port in shards:
            cmd = embed_server_cmd(shard, port)
            proc = start_server(cmd, self.logs, f"server-{len(self.procs)}")
            self.procs.append(proc)
            pending.append(proc)
        out = []
        for proc in pending:
            ready = proc.wait_ready(STARTUP_S)
            assert ready.role == "embeddings" and ready.grpc, ready
            assert proc.popen is not None
            out.append(ServerProc(proc.popen, ready.grpc, proc.log_path))
        return out

    def close(self) -> None:
        stop_all(self.procs, timeout_s=5.0)


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
