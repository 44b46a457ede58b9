"""Starting, waiting for and stopping the processes of a local cluster (``recserve/cluster.py``
starts them, ``recserve/cluster_lifecycle.py`` restarts and stops them): each in its own session
with its output in a log file, ready once it prints its ready line (``common/ready.py``), stopped
with SIGTERM then SIGKILL (``common/process.py``)."""

from __future__ import annotations

from pathlib import Path

from common import process
from recserve.cluster_state import ClusterError, Proc


def start_proc(name: str, role: str, cmd: list[str], logs: Path) -> Proc:
    """Starts one process (``common/process.py``), its output appended to its log (a restart
    appends); in its own session: it outlives ``cluster up``, a Ctrl-C there does not reach it."""
    started = process.start(cmd, log_path=logs / f"{name}.log", new_session=True, name=name)
    return Proc(
        name,
        role,
        cmd,
        started.pid,
        str(started.log_path),
        log_offset=started.log_offset,
        started_at=started.started_at,
    )


def wait_ready(p: Proc, timeout: float) -> None:
    """Waits for the process's ready line (``common/ready.py``); fills in its addresses."""
    try:
        ready = p.handle().wait_ready(timeout)
    except process.ProcessError as e:
        raise ClusterError(str(e)) from None
    p.address, p.http, p.metrics = ready.grpc or "", ready.http or "", ready.metrics or ""
    _fix_port(p)


def _fix_port(p: Proc) -> None:
    """Records the bound port in the command line, so a restart comes back on the same one."""
    port = p.address.rsplit(":", 1)[1]
    flag = "--grpc-port"  # every server's
    if flag in p.cmd:
        p.cmd[p.cmd.index(flag) + 1] = port


def stop_procs(procs: list[Proc], timeout: float) -> list[str]:
    """SIGTERM each process group, wait up to ``timeout`` s, SIGKILL the rest (together, via
    ``common/process.py``); the names of those that needed SIGKILL."""
    return [h.name for h in process.stop_all([p.handle() for p in procs], timeout)]
