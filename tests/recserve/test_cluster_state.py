"""The cluster file under concurrent commands (``recserve/cluster_state.py``): two restarts of one
server at once, a restart that times out or is killed mid-wait, a pid the system reused, a held
lock. After ``down`` no process of the cluster is left (found by its repository path in
``/proc/*/cmdline``, tracked or not) and its ports are free. The cluster is the smallest one:
one document shard and the router, no embedding server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import process
from recserve.cluster import Cluster, down, status
from recserve.cluster_state import LOCK_FILE, Proc, locked
from serving.repository.repository import ModelRepository
from support.tiny_model import Tiny
from support.waiting import wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]
SHARD = "shard-0-0"


def recserve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args], capture_output=True, text=True, timeout=timeout
    )


def recserve_bg(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "recserve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def processes_with(text: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line contains ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def port_free(address: str) -> bool:
    """A server could bind it again (SO_REUSEADDR, as servers do: closed connections may wait
    in TIME_WAIT; only a listener refuses)."""
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny: Tiny) -> Path:
    repo = tmp_path_factory.mktemp("cluster-state") / "repo"
    ModelRepository(repo).publish("demo", tiny.model, shards=1)
    return repo


@pytest.fixture
def cluster(published: Path, tmp_path: Path):
    """(cluster dir, repository path): a cluster up; `down` (and a check) at the end."""
    d = tmp_path / "run"
    up = recserve(
        "cluster", "up", "--model-repo", str(published), "--shards", "1",
        "--embedding-servers", "0", "--directory", str(d),
    )  # fmt: skip
    assert up.returncode == 0, up.stderr + up.stdout
    yield d, str(published)
    if (d / "cluster.json").exists():
        recserve("cluster", "down", "--directory", str(d), "--timeout", "5")
    # the repository is shared by the module's clusters; one at a time, so none may be left
    for pid in processes_with(str(published)):
        os.kill(pid, signal.SIGKILL)


def kill_shard(d: Path) -> Proc:
    shard = Cluster.load(d).find(SHARD)
    os.kill(shard.pid, signal.SIGKILL)
    wait_until(lambda: not shard.alive(), 10, "the shard is gone")
    return shard


def down_leaves_nothing(d: Path, repo: str, addresses: list[str]) -> str:
    out = recserve("cluster", "down", "--directory", str(d))
    assert out.returncode == 0, out.stdout + out.stderr
    assert processes_with(repo) == [], out.stdout
    assert all(port_free(a) for a in addresses), addresses
    assert not (d / "cluster.json").exists()
    return out.stdout


@pytest.mark.slow
def test_two_concurrent_restarts_start_one_process_and_down_stops_all(cluster):
    d, repo = cluster
    before = Cluster.load(d)
    addresses = [p.address for p in before.processes]
    kill_shard(d)
    runs = [recserve_bg("cluster", "restart", SHARD, "--directory", str(d)) for _ in range(2)]
    outs = [r.communicate(timeout=180) for r in runs]
    assert [r.returncode for r in runs] == [0, 0], outs
    now = Cluster.load(d).find(SHARD)
    assert now.alive() and now.pid != before.find(SHARD).pid
    assert all(f"(pid {now.pid})" in out for out, _ in outs), outs  # one process, both saw it
    assert sorted(processes_with(repo)) == sorted(p.pid for p in Cluster.load(d).processes)
    assert [row.note for row in status(d)] == ["serving", "serving"]
    said = down_leaves_nothing(d, repo, addresses)
    assert f"stopped {SHARD} (pid {now.pid})" in said and "stopped router" in said


@pytest.mark.slow
def test_a_restart_that_times_out_stops_its_process(cluster):
    d, repo = cluster
    addresses = [p.address for p in Cluster.load(d).processes]
    old = kill_shard(d)
    out = recserve("cluster", "restart", SHARD, "--directory", str(d), "--timeout", "0.2")
    assert out.returncode == 2 and "not ready after" in out.stderr, out.stdout + out.stderr
    recorded = Cluster.load(d).find(SHARD)
    assert recorded.pid != old.pid and not recorded.alive()  # recorded, then stopped
    rows = {row.proc.name: row for row in status(d)}
    assert rows[SHARD].note == "down" and rows["router"].note == "serving"
    said = down_leaves_nothing(d, repo, addresses)
    assert f"already gone: {SHARD} (pid {recorded.pid})" in said


@pytest.mark.slow
def test_a_restart_killed_while_waiting_leaves_its_process_to_down(cluster):
    """The new process is in the cluster file before the ready wait: SIGSTOP keeps it from ever
    being ready, SIGKILL of the restart command leaves it running, and ``down`` stops it."""
    d, repo = cluster
    addresses = [p.address for p in Cluster.load(d).processes]
    old = kill_shard(d)
    run = recserve_bg("cluster", "restart", SHARD, "--directory", str(d))
    fresh = wait_until(
        lambda: (p := Cluster.load(d).find(SHARD)).pid != old.pid and p, 60, "new pid recorded"
    )
    os.kill(fresh.pid, signal.SIGSTOP)
    run.kill()
    run.communicate(timeout=30)
    assert fresh.alive()
    said = down_leaves_nothing(d, repo, addresses)
    assert f"stopped {SHARD} (pid {fresh.pid})" in said


def sleeper(tmp_path: Path) -> process.Proc:
    """A process of ours (the marker in its command line) that is no server."""
    return process.start(
        [sys.executable, "-c", "import time, sys; time.sleep(120)", "recserve"],
        log_path=tmp_path / "sleeper.log",
        new_session=True,
    )


def write_cluster(d: Path, procs: list[Proc]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    Cluster("demo", 1, procs).save(d)


def test_a_reused_pid_is_never_signalled(tmp_path):
    """A recorded pid whose start time differs is another process now (even one with the
    marker): ``down`` reports it gone and leaves it running; one that matches is stopped."""
    d = tmp_path / "run"
    stranger, ours = sleeper(tmp_path), sleeper(tmp_path)
    try:
        assert stranger.started_at is not None and ours.started_at is not None
        recorded = [
            Proc("shard-0-0", "shard", stranger.cmd, stranger.pid, str(stranger.log_path),
                 started_at=stranger.started_at - 1),
            Proc("router", "router", ours.cmd, ours.pid, str(ours.log_path),
                 started_at=ours.started_at),
        ]  # fmt: skip
        write_cluster(d, recorded)
        rows = status(d)
        assert [(r.alive, r.note) for r in rows] == [(False, "down"), (True, "not serving")]
        report = down(d, timeout=5)
        assert report.gone == [("shard-0-0", stranger.pid)]
        assert report.stopped == [("router", ours.pid)]
        assert stranger.alive() and not ours.alive()
    finally:
        process.stop_all([stranger, ours], 5)


@pytest.mark.slow
def test_status_and_down_survive_a_dead_pid(tmp_path):
    d = tmp_path / "run"
    gone = sleeper(tmp_path)
    gone.stop(5)
    write_cluster(d, [Proc("embed-0", "embedding-server", gone.cmd, gone.pid, str(gone.log_path),
                           address="127.0.0.1:1", started_at=gone.started_at)])  # fmt: skip
    out = recserve("cluster", "status", "--directory", str(d))
    assert out.returncode == 1 and "down" in out.stdout, out.stdout + out.stderr
    out = recserve("cluster", "down", "--directory", str(d))
    assert out.returncode == 0 and f"already gone: embed-0 (pid {gone.pid})" in out.stdout


HOLD = """
import sys, time
from pathlib import Path
from recserve.cluster_state import locked
with locked(Path(sys.argv[1]), "restart shard-0-0"):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
def test_the_lock_times_out_naming_its_holder_and_dies_with_it(tmp_path):
    d = tmp_path / "run"
    write_cluster(d, [])
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(d)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        start = time.monotonic()
        out = recserve("cluster", "down", "--directory", str(d), "--lock-timeout", "0.5")
        assert out.returncode == 2, out.stdout + out.stderr
        assert str(d / LOCK_FILE) in out.stderr
        assert f"pid {holder.pid} (cluster restart shard-0-0)" in out.stderr
        assert time.monotonic() - start < 30
        assert (d / "cluster.json").exists()
    finally:
        holder.kill()
        holder.wait(30)
    with locked(d, "test", timeout=5):  # the OS released the killed holder's lock
        pass
