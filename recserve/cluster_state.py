"""The cluster file (``cluster.json``: processes, pids, addresses), its lock, and which recorded
pid is still ours.

Every read-modify-write of the file happens under :func:`locked`: an exclusive ``fcntl.flock`` on
``cluster.lock`` beside it (the OS releases it when the holder dies, so a killed command never
leaves the cluster locked). Waiting for it is bounded: after ``timeout`` s the error names the
lock file and the holder (pid and command, which the holder writes into the lock file). Readers
that change nothing (``status``) need no lock: the file is replaced atomically
(``common/atomic.py``, a unique temp name per writer), so a reader sees one whole version.

A recorded process is ours only while its pid has the recorded start time (``/proc/PID/stat``)
and its command line holds :data:`MARKER`: a pid the system gave to another program since, even
another recserve one, is never signalled. ``retired`` keeps the processes a restart superseded
until they are verified gone, so ``down`` stops everything the file ever tracked.

    with locked(directory, "restart shard-1-0"):
        cluster = Cluster.load(directory)
        ...
        cluster.save(directory)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import process
from common.atomic import atomic_write_json

CLUSTER_FILE = "cluster.json"
LOCK_FILE = "cluster.lock"
LOCK_TIMEOUT_S = 30.0
"""How long a command waits for another one's lock (``down`` may hold it ~20 s while it drains)."""
MARKER = "recserve"
"""In the command line of every process of a cluster: a recorded pid whose command line lacks
it was given to another program since, and is never signalled."""
_POLL_S = 0.05


class ClusterError(RuntimeError):
    """The cluster cannot start (the message says which process and why, with its log tail)."""


@dataclass
class Proc:
    """One process of the cluster, as the cluster file records it."""

    name: str
    role: str
    cmd: list[str]
    pid: int
    log: str
    address: str = ""
    """gRPC ``host:port``."""
    http: str = ""
    metrics: str = ""
    log_offset: int = 0
    """Where this run of the process starts in its log (earlier runs' lines come before)."""
    started_at: int | None = None
    """The pid's start time (``common.process.start_time``); None in files written before it
    was recorded (then only :data:`MARKER` identifies the process)."""
    via: str = ""
    """``host:port`` of the relay in front of it (``--hosts netns`` with a network profile:
    ``recserve/cluster_hosts.py``); callers go through it. "": none, call ``address``."""

    @property
    def reach(self) -> str:
        """Where callers reach it: through its host's relay, if it has one."""
        return self.via or self.address

    def handle(self) -> process.Proc:
        """The launcher's handle on it (this run may not be the one that started it)."""
        return process.Proc.adopt(
            self.pid,
            self.cmd,
            Path(self.log),
            marker=MARKER,
            log_offset=self.log_offset,
            name=self.name,
            started_at=self.started_at,
        )

    def alive(self) -> bool:
        """It runs (not exited, not a zombie) and the pid is still this process."""
        return self.handle().alive()


@dataclass
class Cluster:
    model: str
    version: int
    processes: list[Proc] = field(default_factory=list)
    tls_ca: str = ""
    """CA of the processes' TLS certificate ("": they serve plaintext)."""
    retired: list[Proc] = field(default_factory=list)
    """Processes a restart replaced, kept until verified gone (``down`` stops any alive)."""
    hosts: dict = field(default_factory=dict)
    """``--hosts netns``: the namespaces the processes run in (``HostSet.to_json``); {}: all
    on 127.0.0.1."""
    network: str = "none"
    """``--hosts netns``: the network profile the relays started with."""

    @property
    def router(self) -> Proc:
        return next(p for p in self.processes if p.role == "router")

    def tracked(self) -> list[Proc]:
        """Every process the file knows: the current ones, then the retired ones."""
        return [*self.processes, *self.retired]

    def find(self, name: str) -> Proc:
        for p in self.processes:
            if p.name == name:
                return p
        raise ClusterError(f"no process {name!r} (have: {[p.name for p in self.processes]})")

    def replace(self, old: Proc, new: Proc) -> None:
        """``new`` takes ``old``'s place; ``old`` is retired (dropped once it is gone, as are
        earlier retired processes found gone)."""
        self.processes[self.processes.index(old)] = new
        self.retired = [p for p in [*self.retired, old] if p.alive()]

    def save(self, directory: Path) -> Path:
        path = directory / CLUSTER_FILE
        atomic_write_json(path, asdict(self))
        return path

    @classmethod
    def load(cls, directory: Path) -> Cluster:
        path = directory / CLUSTER_FILE
        if not path.is_file():
            raise ClusterError(
                f"no cluster file at {path} (is a cluster up? `recserve cluster up`)"
            )
        try:
            d = json.loads(path.read_text())
            return cls(
                d["model"],
                d["version"],
                [Proc(**p) for p in d["processes"]],
                d.get("tls_ca", ""),
                [Proc(**p) for p in d.get("retired", [])],
                d.get("hosts", {}),
                d.get("network", "none"),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ClusterError(f"{path}: not a cluster file ({type(e).__name__}: {e})") from None


@contextlib.contextmanager
def locked(directory: Path, what: str, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Holds the cluster's exclusive lock (see the module docstring); ``what`` (e.g. ``"down"``)
    tells a waiting command who holds it. Not re-entrant: a second ``locked`` of the same
    directory in one process waits for the first. :class:`ClusterError` after ``timeout`` s."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        until = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= until:
                    raise ClusterError(
                        f"cluster state locked: {path} is held by {holder(path)}; waited "
                        f"{timeout:g} s (--lock-timeout)"
                    ) from None
                time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": what}).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock


def holder(path: Path) -> str:
    """Who holds the lock at ``path``, as its holder wrote it: ``pid 123 (cluster down)``."""
    try:
        d = json.loads(path.read_text())
        return f"pid {int(d['pid'])} (cluster {d['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"
