"""Issue 18 over real processes: two shards, shard 0 with two replica processes, behind a router
(in this process, so its registry and log are at hand) under steady load from a few threads. A replica
frozen by SIGSTOP (alive, socket open, never answering) is ejected after a few calls, so at most
a few answers are partial; after SIGCONT a probe brings it back and calls reach it again."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from serving.app.config import RouterConfig, ServeConfig
from serving.app.server import Server
from serving.repository.repository import ModelRepository
from support.process_util import STARTUP_S, recserve_cmd, start_server
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(300)]

THREADS = 4
PARTIAL_PER_THREAD = 3
"""The bound of the issue: while the replica is frozen, at most this many partial answers per
client thread (the calls in flight to it before it is out; adaptive hedging saves most)."""
DEADLINE_MS = 400.0  # room for a busy 2-core host, as in tests/recserve/test_cluster.py


class Load:
    """``THREADS`` threads calling the router back to back; ``seen``: (whole, latency s) per
    call (not whole: partial, or an error)."""

    def __init__(self, server: Server, wide):
        self.state, self.wide = server.state, wide
        self.seen: list[tuple[bool, float]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(t,)) for t in range(THREADS)]

    def _run(self, t: int) -> None:
        u = t
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                whole = not self.state.recommend(self.wide.request(u % 32, 20)).partial
            except Exception:  # counted as not whole, like a partial answer
                whole = False
            self.seen.append((whole, time.monotonic() - start))
            u += THREADS

    def __enter__(self) -> Load:
        for th in self._threads:
            th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(30)

    def wait(self, n: int, what: str) -> int:
        """Until ``n`` more answers came -> the count then."""
        mark = len(self.seen)
        wait_until(lambda: len(self.seen) >= mark + n, 120, what)
        return len(self.seen)


@pytest.mark.parametrize("wide", ["plain"], indirect=True)
def test_a_frozen_replica_is_ejected_then_probed_back(wide, tmp_path, caplog):
    repo = ModelRepository(tmp_path / "repo")
    repo.publish("demo", wide.model, shards=2)

    def shard(s: int, name: str):
        cmd = recserve_cmd(
            "serve", "shard", "--model-repo", tmp_path / "repo", "--shard", str(s),
            "--grpc-port", "0", "--poll-s", "0", "--torch-threads", "1",
        )  # fmt: skip
        return start_server(cmd, tmp_path, name)

    procs = [shard(0, "shard-0-0"), shard(0, "shard-0-1"), shard(1, "shard-1-0")]
    frozen = False
    server = None
    try:
        addresses = [p.wait_ready(STARTUP_S).grpc or "" for p in procs]
        assert all(addresses)
        registry = CollectorRegistry()
        # every replica health and hedging setting is the default
        config = RouterConfig(shards=[addresses[:2], addresses[2:]], shard_deadline_ms=DEADLINE_MS)
        server = Server(
            ServeConfig(
                model_repo=tmp_path / "repo", model="demo", grpc_port=0, poll_s=0, router=config
            ),
            registry=registry,
        )
        server.start()
        a = addresses[0]

        def metric(name: str, **labels: str) -> float:
            value = registry.get_sample_value(name, {"model": "demo", "shard": "0", **labels})
            return value or 0.0

        caplog.set_level(logging.INFO, logger="serving.sharding.shard_client")
        with Load(server, wide) as load:
            before = load.wait(40, "answers before the freeze")
            os.kill(procs[0].pid, signal.SIGSTOP)
            frozen = True
            wait_until(
                lambda: metric("recserve_replicas_in_rotation") == 1, 60, "the frozen one out"
            )
            wait_until(
                lambda: metric("recserve_replica_probes_total", replica=a) >= 2, 60, "2 probes"
            )
            paused_to = load.wait(200, "answers while frozen")
            assert metric("recserve_replicas_in_rotation") == 1  # its probes failed: still out
            os.kill(procs[0].pid, signal.SIGCONT)
            frozen = False
            answered = metric("recserve_replica_answers_total", replica=a)
            resumed_at = time.monotonic()
            wait_until(lambda: metric("recserve_replicas_in_rotation") == 2, 60, "probed back")
            back_after = time.monotonic() - resumed_at
            wait_until(
                lambda: metric("recserve_replica_answers_total", replica=a) >= answered + 20,
                60,
                "calls reach the resumed replica again",
            )
            load.wait(20, "answers after it returned")
        paused = load.seen[before:paused_to]
        partial = sum(not whole for whole, _ in paused)
        lat = sorted(lat for _, lat in paused)
        print(
            f"{partial} of {len(paused)} answers partial (or failed) while a replica was "
            f"frozen; latency p50 {lat[len(lat) // 2] * 1e3:.0f} ms, p99 {lat[int(len(lat) * 0.99)] * 1e3:.0f} "
            f"ms; back in rotation {back_after:.2f} s after SIGCONT"
        )
        assert partial <= PARTIAL_PER_THREAD * THREADS, partial
        assert max(lat for _, lat in paused) < DEADLINE_MS / 1000 * 2 + 1.0  # never a hang
        ejections = metric("recserve_replica_ejections_total", replica=a)
        assert ejections >= 1
        out = [r for r in caplog.records if a in r.getMessage() and "out of rotation" in r.message]
        back = [
            r for r in caplog.records if a in r.getMessage() and "back in rotation" in r.message
        ]
        assert len(out) == ejections and len(back) == ejections  # one line each, not per call
        # the healthy replica was never ejected
        assert metric("recserve_replica_ejections_total", replica=addresses[1]) == 0
    finally:
        if frozen:
            os.kill(procs[0].pid, signal.SIGCONT)
        if server is not None:
            server.drain_and_stop(timeout=5)
        for p in procs:
            p.stop()
