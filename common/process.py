"""Starting a server process, waiting for its ready line, stopping it -- for ``recserve cluster``,
the benchmarks and the tests alike::

    with start([sys.executable, "-m", "recserve", ...], log_path=logs / "serve.log") as proc:
        ready = proc.wait_ready(60.0)   # common/ready.py's ReadyLine: ready.grpc, ready.http, ...
        ...                             # leaving the block stops it (SIGTERM, then SIGKILL)

The child's stdout and stderr both go to ``log_path`` (appended: a restart keeps the earlier
runs' lines, and :attr:`Proc.log_offset` says where this run starts), so nothing blocks on a
full pipe and an error names the tail of what it wrote. Stdin is closed; ``PYTHONUNBUFFERED``
is set so log lines arrive as written.

With ``new_session=True`` the child leads its own session and process group: a Ctrl-C in the
starting terminal does not reach it, it may outlive its starter (``recserve cluster up``), and
:meth:`Proc.stop` signals the whole group (a server's own children included). A process started
by another program run (a pid in a cluster file) is :meth:`Proc.adopt`-ed to stop it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from common.ready import ReadyLine, parse_ready

POLL_S = 0.05
REAP_S = 5.0
"""How long a SIGKILLed process gets to disappear."""
TAIL_LINES = 30


class ProcessError(RuntimeError):
    """A process exited before it was ready, or was not ready in time (with its output's tail)."""


class Proc:
    """A server process: started by :func:`start` (``popen`` set) or adopted by pid."""

    def __init__(
        self,
        pid: int,
        cmd: Sequence[str],
        log_path: Path,
        *,
        log_offset: int = 0,
        session: bool = False,
        popen: subprocess.Popen[bytes] | None = None,
        marker: str | None = None,
        name: str | None = None,
        temp_log: bool = False,
        started_at: int | None = None,
    ):
        self.pid = pid
        self.cmd = list(cmd)
        self.log_path = log_path
        self.log_offset = log_offset
        """Where this run of the process starts in its log."""
        self.session = session
        self.popen = popen
        self.marker = marker
        self.name = name or shlex.join(self.cmd)[:120]
        self.ready: ReadyLine | None = None
        """The ready line, once :meth:`wait_ready` has seen it."""
        self._read_at = log_offset
        self._temp_log = temp_log
        self.started_at = started_at
        """Its :func:`start_time` (adopted: the recorded one, checked by :meth:`alive`)."""

    @classmethod
    def adopt(
        cls,
        pid: int,
        cmd: Sequence[str],
        log_path: Path,
        *,
        marker: str,
        log_offset: int = 0,
        session: bool = True,
        name: str | None = None,
        started_at: int | None = None,
    ) -> Proc:
        """A process another run started (its pid recorded in a file). It counts as alive only
        while its command line contains ``marker`` and, when ``started_at`` is given, while the
        pid's :func:`start_time` equals it: a pid the system gave to another program since (even
        another of ours, with the marker) is never signalled."""
        return cls(
            pid,
            cmd,
            log_path,
            log_offset=log_offset,
            session=session,
            marker=marker,
            name=name,
            started_at=started_at,
        )

    # ---- state --------------------------------------------------------------------------------
    def alive(self) -> bool:
        """Running (not exited, not a zombie)."""
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                return False
            if self.started_at is not None and int(fields[19]) != self.started_at:
                return False  # the pid was reused
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if not cmdline and self.started_at is not None:
                return True  # exiting (memory gone, not a zombie yet); ours by its start time
            return self.marker is None or self.marker.encode() in cmdline
        except (OSError, IndexError, ValueError):
            return False

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (None while running, and for an adopted process)."""
        return None if self.popen is None else self.popen.poll()

    def wait(self, timeout_s: float) -> int | None:
        """Waits up to ``timeout_s`` for it to exit; its status (None: still running or
        adopted)."""
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return self.popen.wait(timeout_s)
            return None
        until = time.monotonic() + timeout_s
        while True:
            _reap(self.pid)  # a child of this program run (up and down in one process) too
            if not self.alive() or time.monotonic() > until:
                return None
            time.sleep(POLL_S)

    def tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines this run wrote."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    # ---- ready --------------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> ReadyLine:
        """Reads the output until the ready line; :class:`ProcessError` with the output's tail
        when the process exits first or ``timeout_s`` passes."""
        until = time.monotonic() + timeout_s
        while True:
            exited = not self.alive()  # before reading: a line written just before exit counts
            for line in self._new_lines():
                ready = parse_ready(line)
                if ready is not None:
                    self.ready = ready
                    return ready
            if exited:
                status = "" if self.returncode is None else f" with status {self.returncode}"
                raise ProcessError(
                    f"{self.name} exited{status} before it was ready:\n{self.tail()}"
                )
            if time.monotonic() > until:
                raise ProcessError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(POLL_S)

    def _new_lines(self) -> list[bytes]:
        """Complete lines written since the last call (a partial last line waits)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._read_at)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._read_at += end
        return data[:end].splitlines()

    # ---- stop ---------------------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        """Sends ``sig`` to its process group (with ``session``) or to it, if it is alive."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            if self.session:
                try:
                    os.killpg(self.pid, sig)
                    return
                except PermissionError:
                    pass
            os.kill(self.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """SIGTERM (it drains), SIGKILL after ``timeout_s``, reaped; True when it needed
        SIGKILL. Idempotent."""
        return bool(stop_all([self], timeout_s))

    def __enter__(self) -> Proc:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    cwd: Path | None = None,
    new_session: bool = False,
    name: str | None = None,
) -> Proc:
    """Starts ``cmd`` with stdout and stderr appended to ``log_path`` (None: a temporary file,
    removed by :meth:`Proc.stop`); ``env`` replaces this process's environment (None: inherit).
    See the module docstring."""
    temp_log = log_path is None
    if log_path is None:
        fd, tmp = tempfile.mkstemp(prefix="recserve-proc-", suffix=".log")
        os.close(fd)
        log_path = Path(tmp)
    offset = log_path.stat().st_size if log_path.exists() else 0
    child_env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as out:
        popen = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=child_env,
            start_new_session=new_session,
        )
    return Proc(
        popen.pid,
        cmd,
        log_path,
        log_offset=offset,
        session=new_session,
        popen=popen,
        name=name,
        temp_log=temp_log,
        started_at=start_time(popen.pid),
    )


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22); None when
    there is no such process. Pid and start time name one process: a pid the system reuses
    comes with a later start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def stop_all(procs: Sequence[Proc], timeout_s: float) -> list[Proc]:
    """Stops them together: SIGTERM to each, up to ``timeout_s`` for all to exit, SIGKILL to
    the rest; every one reaped. Returns those that needed SIGKILL."""
    for p in procs:
        p.signal(signal.SIGCONT)  # a stopped process handles SIGTERM only once continued
        p.signal(signal.SIGTERM)
    _wait_all(procs, timeout_s)
    killed = [p for p in procs if p.alive()]
    for p in killed:
        p.signal(signal.SIGKILL)
    for p in procs:
        # the group's stragglers (children that outlived it); only for a group started by this
        # run: an adopted pid's group may since be another program's
        if p.session and p.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    _wait_all(procs, REAP_S)
    for p in procs:
        if p._temp_log:
            p.log_path.unlink(missing_ok=True)
    return killed


def _wait_all(procs: Sequence[Proc], timeout_s: float) -> None:
    until = time.monotonic() + timeout_s
    for p in procs:
        p.wait(max(until - time.monotonic(), 0.0))


def _reap(pid: int) -> None:
    """Collects ``pid`` if it is an exited child of this process (adopted, started here)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
