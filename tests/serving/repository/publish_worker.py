"""A publisher process for ``test_publish_faults.py``: each publish runs in a forked child, so the
test can SIGKILL one at any point without paying for a fresh ``import torch`` every round.

Run as ``python publish_worker.py <model folder>`` (a folder written by
``retrieval.artifact.save_model``); :class:`Worker` starts and drives it. It loads that model once
(one torch thread, so forking is safe), prints ``ready``, then reads commands, one per stdin line:

    publish <repo root> <name> <keep>    fork; the child publishes the model once
    fsize <repo root> <name> <bytes>     fork; the child publishes with RLIMIT_FSIZE = <bytes>:
                                         a write past it fails in the kernel (EFBIG), the same
                                         path a full disk takes, torch's writer included
    halt <repo root> <name> <point> <mbs>  fork; the child publishes with max_batch_size <mbs>
                                         and stops at <point> (:data:`HALT_POINTS`) for good,
                                         saying ``at <pid> <point>`` first: the test kills it

Replies on stdout, one line each (children write with one ``os.write``, so lines never mix):
``forked <pid>``; from the child ``start <pid>`` just before ``publish``, ``at <pid> <point>``
(halt), and then
``done <pid> <version>`` or ``error <pid> <exception type> <message on one line>``; and
``exit <pid> <how>`` once the child is reaped (``how``: ``signal <n>`` or ``code <n>``), which
waits for a ``reap`` line: until then the child's pid cannot be reused, so the test may kill it.
"""

from __future__ import annotations

import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
WAIT = 60.0
HALT_POINTS = ("before-rename", "after-rename", "before-config", "after-config")
"""Where ``halt`` stops a publish: just before / after its version's rename, just before / after
the ``os.replace`` that puts the model-level ``config.pbtxt`` in place."""


class Worker:
    """Starts ``publish_worker.py`` over ``model_dir`` and sends it commands."""

    def __init__(self, model_dir: Path, log: Path):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.log = log
        self._stderr = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(model_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True, cwd=ROOT, env=env,
        )  # fmt: skip
        self.lines: queue.Queue[list[str]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next() == ["ready"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n").split(" ", 3))

    def next(self) -> list[str]:
        """The next reply, split in at most 4 words."""
        try:
            return self.lines.get(timeout=WAIT)
        except queue.Empty:
            raise TimeoutError(f"publish worker silent: {self.log.read_text()}") from None

    def run(
        self, *words: object, kill_at: float | None = None, kill_on: str | None = None
    ) -> list[list[str]]:
        """One command -> its replies; ``kill_at``: SIGKILL the child that many seconds after
        sending the command (at once if the fork took longer); ``kill_on``: SIGKILL it once it
        says a line starting with that word (unless it finished first)."""
        assert self.proc.stdin is not None
        sent = time.monotonic()
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        lines = [self.next()]
        while lines[-1][0] != "forked":
            lines.append(self.next())
        pid = int(lines[-1][1])
        while kill_on is not None and lines[-1][0] not in (kill_on, "done", "error"):
            lines.append(self.next())
        if kill_on is not None and lines[-1][0] == kill_on:
            os.kill(pid, signal.SIGKILL)  # it waits there for good
        if kill_at is not None:
            time.sleep(max(0.0, sent + kill_at - time.monotonic()))
            os.kill(pid, signal.SIGKILL)  # our child, not yet reaped: the pid is still its
        self.proc.stdin.write("reap\n")
        self.proc.stdin.flush()
        while lines[-1][:2] != ["exit", str(pid)]:
            lines.append(self.next())
        return lines

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT)
        for f in (self.proc.stdin, self.proc.stdout, self._stderr):
            if f is not None:
                f.close()


# ---- the worker process ---------------------------------------------------------------------
def say(line: str) -> None:
    os.write(1, (line.replace("\n", " | ") + "\n").encode())


def halt_at(point: str, mdir: Path) -> None:
    """Makes this process stop for good at ``point`` of a publish into ``mdir``."""
    from serving.repository.config import CONFIG_FILE

    assert point in HALT_POINTS, point
    real_rename, real_replace = os.rename, os.replace

    def stop_at(here: str) -> None:
        if here == point:
            say(f"at {os.getpid()} {point}")
            while True:
                signal.pause()

    def rename(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        publishing = Path(dst).parent == mdir and Path(dst).name.isdigit()
        if publishing:
            stop_at("before-rename")
        real_rename(src, dst, *args, **kw)
        if publishing:
            stop_at("after-rename")

    def replace(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        configuring = Path(dst) == mdir / CONFIG_FILE
        if configuring:
            stop_at("before-config")
        real_replace(src, dst, *args, **kw)
        if configuring:
            stop_at("after-config")

    os.rename, os.replace = rename, replace  # this child only: it never returns


def child(model: Any, command: str, root: str, name: str, arg: str, rest: list[str]) -> None:
    """Runs in the forked child; never returns (``os._exit`` skips the parent's atexit/flush)."""
    from serving.repository.repository import ModelRepository

    pid = os.getpid()
    code = 0
    try:
        keep = int(arg) if command == "publish" else 100
        overrides: dict[str, Any] = {}
        if command == "fsize":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(arg), resource.RLIM_INFINITY))
        if command == "halt":
            halt_at(arg, Path(root) / name)
            overrides["max_batch_size"] = int(rest[0])
        say(f"start {pid}")
        version = ModelRepository(Path(root)).publish(name, model, keep=keep, **overrides)
        say(f"done {pid} {version}")
    except BaseException as e:
        say(f"error {pid} {type(e).__name__} {e}")
        code = 1
    os._exit(code)


def main() -> None:
    import torch

    torch.set_num_threads(1)  # no intra-op pool threads: the forked children stay consistent
    from retrieval.artifact import load_model
    from serving.repository.repository import ModelRepository  # noqa: F401 (import before forks)

    model = load_model(Path(sys.argv[1])).eval()
    say("ready")
    while line := sys.stdin.readline():
        command, root, name, arg, *rest = line.split()
        pid = os.fork()
        if pid == 0:
            child(model, command, root, name, arg, rest)
        say(f"forked {pid}")
        assert sys.stdin.readline() == "reap\n"  # until then the child's pid stays taken
        _, status = os.waitpid(pid, 0)
        how = (
            f"signal {os.WTERMSIG(status)}"
            if os.WIFSIGNALED(status)
            else f"code {os.WEXITSTATUS(status)}"
        )
        say(f"exit {pid} {how}")


if __name__ == "__main__":
    main()
