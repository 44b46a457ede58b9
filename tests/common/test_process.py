"""The one launcher (``common/process.py``) with tiny ``python -c`` children: the ready line's
fields come back; a child that exits early or never announces fails with its output's tail; stop
escalates to SIGKILL for a child that ignores SIGTERM, reaps it, and may be called twice."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from common.process import Proc, ProcessError, start, stop_all

pytestmark = pytest.mark.multiproc

ANNOUNCE = """
import logging, sys, time
from common.ready import announce
logging.basicConfig(level=logging.INFO)
print("loading the model", file=sys.stderr, flush=True)
print("a stdout line that is not the ready line", flush=True)
announce("serve", grpc="127.0.0.1:1234", http=None, model="demo", version=3, shard=1)
time.sleep(60)
"""


def child(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_wait_ready_returns_the_announced_fields(tmp_path: Path):
    log = tmp_path / "child.log"
    with start(child(ANNOUNCE), log_path=log, cwd=Path.cwd()) as proc:
        ready = proc.wait_ready(30.0)
        assert (ready.role, ready.pid, ready.grpc, ready.http) == (
            "serve", proc.pid, "127.0.0.1:1234", None
        )  # fmt: skip
        assert (ready.model, ready.version, dict(ready.extras)) == ("demo", 3, {"shard": 1})
        assert proc.ready == ready and proc.alive()
        assert "loading the model" in log.read_text()  # stderr goes to the same log
    assert not proc.alive() and proc.returncode is not None


def test_a_restart_appends_to_the_log_and_reads_only_its_own_lines(tmp_path: Path):
    log = tmp_path / "child.log"
    log.write_text('{"event": "ready", "role": "old", "pid": 1}\n')
    with start(child(ANNOUNCE), log_path=log) as proc:
        assert proc.log_offset > 0
        assert proc.wait_ready(30.0).role == "serve"
    assert log.read_text().startswith('{"event": "ready", "role": "old"')


def test_a_child_that_exits_early_fails_naming_its_output(tmp_path: Path):
    code = "import sys; print('cannot bind 127.0.0.1:1', file=sys.stderr); sys.exit(2)"
    proc = start(child(code), log_path=tmp_path / "child.log", name="shard-0")
    with pytest.raises(ProcessError, match=r"shard-0 exited with status 2 before it was ready"):
        try:
            proc.wait_ready(30.0)
        except ProcessError as e:
            assert "cannot bind 127.0.0.1:1" in str(e)
            raise
    proc.stop()


def test_a_child_that_never_announces_times_out_with_its_tail():
    proc = start(child("import time; print('still loading', flush=True); time.sleep(60)"))
    try:
        started = time.monotonic()
        with pytest.raises(ProcessError, match=r"not ready after 1 s:\nstill loading"):
            proc.wait_ready(1.0)
        assert time.monotonic() - started < 10
    finally:
        proc.stop(timeout_s=5.0)
    assert not proc.log_path.exists()  # a temporary log goes with the process


IGNORES_TERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
time.sleep(60)
"""


def test_stop_escalates_to_sigkill_and_reaps(tmp_path: Path):
    proc = start(child(IGNORES_TERM), log_path=tmp_path / "child.log", new_session=True)
    until = time.monotonic() + 30
    while "ignoring SIGTERM" not in proc.tail() and time.monotonic() < until:
        time.sleep(0.05)
    started = time.monotonic()
    assert proc.stop(timeout_s=0.5) is True  # needed SIGKILL
    assert time.monotonic() - started < 10
    assert proc.returncode == -9 and not proc.alive()
    assert proc.stop() is False  # again: nothing to do
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)  # reaped: no zombie left


def test_a_process_that_drains_on_sigterm_is_not_killed(tmp_path: Path):
    proc = start(child(ANNOUNCE), log_path=tmp_path / "child.log")
    proc.wait_ready(30.0)
    assert stop_all([proc], timeout_s=10.0) == []
    assert proc.returncode == -15


def test_an_adopted_pid_is_stopped_and_a_stranger_is_left_alone(tmp_path: Path):
    started = start(child(ANNOUNCE), log_path=tmp_path / "child.log", new_session=True)
    started.wait_ready(30.0)
    stranger = Proc.adopt(started.pid, started.cmd, started.log_path, marker="no such program")
    assert not stranger.alive()
    stranger.stop()
    assert started.alive()
    adopted = Proc.adopt(started.pid, started.cmd, started.log_path, marker="common.ready")
    assert adopted.alive()
    assert adopted.stop(timeout_s=10.0) is False
    assert not adopted.alive() and started.wait(5.0) is not None
