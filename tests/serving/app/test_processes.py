"""``recserve serve --processes 2`` as real processes: one port, the same answers as one
process, both processes serving, metrics of both, a killed process restarted while the other
serves, SIGTERM drains all, a killed parent takes its processes with it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.http

from common.process import Proc
from loadtest.workload import OWN_CONNECTION
from serving.app.config import ConfigError, ServeConfig
from serving.app.processes import RESTARTS_PER_MINUTE, reserve_port
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository import repository
from support.process_util import STARTUP_S, serve_cmd, start_server

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

WAIT = 10.0
USERS = list(range(0, 100, 3))
READY = re.compile(r"process (\d+) \(pid (\d+)\) ready")
STARTED = re.compile(r"process 0 \(pid (\d+)\) started")


def start_group(tmp_path: Path, tiny, *extra: str) -> tuple[Proc, Path]:
    """The group, its stdout and stderr (its processes' logs too) in one log."""
    repo = repository.ModelRepository(tmp_path / "repo")
    repo.publish("demo", tiny.model)
    cmd = serve_cmd("--model-repo", tmp_path / "repo", "--model", "demo", "--processes", "2",
                    "--grpc-port", "0", *extra)  # fmt: skip
    proc = start_server(cmd, tmp_path, "serve")
    return proc, proc.log_path


def pids(err: Path) -> dict[int, int]:
    """Slot -> pid of the newest start of each process, from the parent's log."""
    return {int(s): int(p) for s, p in READY.findall(err.read_text())}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (OSError, IndexError):
        return "Z"


def ask_each_on_its_own_connection(address: str, tiny) -> dict[int, list[int]]:
    """Every user's ids, each call on a new connection that waits to be connected (a
    connection the kernel queued at a process as it died is reset: the channel reconnects)."""
    out = {}
    for u in USERS:
        with grpc.insecure_channel(address, options=[OWN_CONNECTION]) as channel:
            stub = RecommenderStub(channel)
            reply = stub.Recommend(tiny.message(u), timeout=WAIT, wait_for_ready=True)
            out[u] = list(reply.item_ids)
    return out


def metric_by_process(metrics: str, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=WAIT).read().decode()
    found = re.findall(rf'^{name}\{{model="demo",process="(\d+)"\}} (\S+)$', text, re.M)
    return {p: float(v) for p, v in found}


def test_a_group_serves_one_port_restarts_a_dead_process_and_drains(tmp_path: Path, tiny):
    proc, err = start_group(tmp_path, tiny, "--http-port", "0", "--metrics-port", "0")
    try:
        ready = proc.wait_ready(STARTUP_S)
        assert (ready.role, ready.model, ready.version, ready.processes) == ("serve", "demo", 1, 2)
        assert ready.pid == proc.pid  # the group's parent announces
        address, http_address, metrics = ready.grpc, ready.http, ready.metrics
        assert address and http_address and metrics
        with torch.inference_mode():
            ids, _ = tiny.model(tiny.prep.user_batch(np.array(USERS)), 10)
        want = dict(zip(USERS, ids.tolist(), strict=True))

        assert ask_each_on_its_own_connection(address, tiny) == want
        counts = metric_by_process(metrics, "recserve_request_duration_seconds_count")
        assert set(counts) == {"0", "1"}  # 34 connections: both processes got some
        assert sum(counts.values()) == len(USERS) and min(counts.values()) > 0
        client = tritonclient.http.InferenceServerClient(http_address)
        assert client.is_server_ready() and client.is_model_ready("demo")
        client.close()

        # kill -9 one process: the other serves meanwhile, the parent starts a new one
        before = pids(err)
        os.kill(before[0], signal.SIGKILL)
        until = time.monotonic() + 90
        while pids(err).get(0, before[0]) == before[0] and time.monotonic() < until:
            assert ask_each_on_its_own_connection(address, tiny)[USERS[0]] == want[USERS[0]]
            time.sleep(0.2)
        after = pids(err)
        assert after[0] != before[0] and after[1] == before[1], err.read_text()[-2000:]
        assert ask_each_on_its_own_connection(address, tiny) == want
        text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=WAIT).read().decode()
        assert "recserve_process_restarts_total 1.0" in text

        # SIGTERM: every process drains and exits, then the parent, status 0
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0, err.read_text()[-2000:]
        assert not any(alive(p) for p in after.values())
    finally:
        proc.stop()


def test_a_crash_loop_ends_the_group_with_status_1(tmp_path: Path, tiny):
    proc, err = start_group(tmp_path, tiny)
    try:
        proc.wait_ready(STARTUP_S)
        killed: set[int] = set()
        until = time.monotonic() + 120
        # kill each new process 0 as soon as it has started (a model that crashes at load)
        while proc.alive() and time.monotonic() < until:
            pid = int(STARTED.findall(err.read_text())[-1 if killed else 0])
            if pid not in killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.05)
        assert proc.wait(30) == 1, err.read_text()[-2000:]
        assert len(killed) == RESTARTS_PER_MINUTE + 1
        assert "deaths within a minute: giving up" in err.read_text()
        assert not any(alive(int(p)) for p in re.findall(r"\(pid (\d+)\) started", err.read_text()))
    finally:
        proc.stop()


def test_processes_leave_when_their_parent_is_killed(tmp_path: Path, tiny):
    proc, err = start_group(tmp_path, tiny)
    try:
        proc.wait_ready(STARTUP_S)
        children = list(pids(err).values())
        assert len(children) == 2 and all(alive(p) for p in children)
        proc.signal(signal.SIGKILL)
        proc.wait(WAIT)
        until = time.monotonic() + 30
        while any(alive(p) for p in children) and time.monotonic() < until:
            time.sleep(0.1)
        assert not any(alive(p) for p in children)
        assert err.read_text().count("the parent process is gone: draining") == 2
    finally:
        proc.stop()


def test_a_taken_port_fails_the_group_at_once(tmp_path: Path, tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, err = start_group(tmp_path, tiny, "--grpc-port", str(port))
        try:
            assert proc.wait(60) == 2
            assert f"grpc_port: cannot bind 127.0.0.1:{port}" in err.read_text()
        finally:
            proc.stop()


def test_a_reserved_port_keeps_strangers_out_and_lets_the_group_in():
    held = reserve_port("127.0.0.1", 0, "grpc_port")
    try:
        port = held.getsockname()[1]
        with socket.socket() as stranger, pytest.raises(OSError):
            stranger.bind(("127.0.0.1", port))
        with socket.socket() as member:
            member.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            member.bind(("127.0.0.1", port))
            member.listen()
        with pytest.raises(OSError, match=f"grpc_port: cannot bind 127.0.0.1:{port}"):
            reserve_port("127.0.0.1", port, "grpc_port")  # another group cannot join
    finally:
        held.close()


def test_live_updates_need_one_process(tmp_path: Path):
    cfg = ServeConfig(model_repo=tmp_path, processes=2, state_dir=tmp_path / "state")
    with pytest.raises(ConfigError, match="processes: live updates"):
        cfg.validate()
    with pytest.raises(ConfigError, match=r"processes \(--processes\): must be in \[1, 256\]"):
        ServeConfig(model_repo=tmp_path, processes=0).validate()
