"""The engine across a ZeroMQ boundary (``EngineLoop`` + ``ZmqEngineClient``, in one process over
IPC sockets): the same answers and refusals as the in-process engine, back-pressure, deadlines
and cancellation crossing, and a dead engine answering UNAVAILABLE (never a hang) until a new
one binds the same sockets."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np
import pytest

from serving.engine.batching import BatchPolicy
from serving.engine.client import InProcessEngine
from serving.engine.host import ModelHost
from serving.engine.metrics import ServingMetrics
from serving.engine.state import ServingState, make_batcher
from serving.engine.zmq_client import ENGINE_TIMEOUT_S, ZmqEngineClient
from serving.engine.zmq_engine import EngineLoop
from serving.types import (
    DeadlineExceededError,
    QueueFullError,
    RecResult,
    RequestError,
    UnavailableError,
)

WAIT = 10.0
QUEUE = 8


def start_engine(repo, policy: BatchPolicy) -> InProcessEngine:
    metrics = ServingMetrics("demo")
    host = ModelHost(repo, "demo", poll_s=0.0, metrics=metrics)
    host.start(poll=False)
    return InProcessEngine(host, make_batcher(host, policy, metrics))


@pytest.fixture
def addresses(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"


@pytest.fixture
def split(repo, addresses) -> Iterator[tuple[InProcessEngine, EngineLoop, ZmqEngineClient]]:
    engine = start_engine(repo, BatchPolicy(8, 0.0, QUEUE))
    loop = EngineLoop(engine, *addresses)
    loop.start()
    client = ZmqEngineClient(*addresses, name="fe-test")
    client.start()
    assert client.wait_ready(WAIT)
    yield engine, loop, client
    client.close()
    engine.batcher.gate.set()
    engine.batcher.stop(drain=False, timeout=WAIT)
    loop.stop()
    loop.close()


def results(futures) -> list[RecResult]:
    return [f.result(WAIT) for f in futures]


def test_answers_and_refusals_cross_unchanged(tiny, split):
    engine, _, client = split
    info, here = client.info(), engine.info()
    assert (info.name, info.version, info.categorical, info.dense, info.max_k) == (
        here.name, here.version, here.categorical, here.dense, here.max_k,
    )  # fmt: skip
    assert info.policy == here.policy
    reqs = [tiny.request(u, k=5 + u % 3) for u in range(6)]
    reqs[1].filter = "language = 'en'"
    reqs[2].seen = np.array([1, 2, 3], dtype=np.int64)
    reqs[3].deadline = time.monotonic() + WAIT
    remote = results(client.submit(reqs))
    local = results(engine.submit([tiny.request(u, k=5 + u % 3) for u in range(6)][:1]))
    local += results(engine.submit([r for r in reqs[1:]]))
    for a, b in zip(remote, local, strict=True):
        assert a.item_ids.tolist() == b.item_ids.tolist()
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-5)  # batches differ
        assert (a.model, a.version, a.partial) == (b.model, b.version, b.partial)

    bad = [tiny.request(0), tiny.request(1, k=0)]
    with pytest.raises(RequestError) as here_err:
        engine.submit(bad)
    with pytest.raises(RequestError) as there_err:
        client.submit(bad)[0].result(WAIT)
    assert str(there_err.value) == str(here_err.value)
    assert "(batch row 1)" in str(there_err.value)


def test_a_full_queue_is_resource_exhausted_and_a_deadline_leaves_the_queue(tiny, split):
    engine, _, client = split
    engine.batcher.gate.clear()  # the worker holds: the queue fills
    state = ServingState(client, ServingMetrics("demo"))
    held = [client.submit([tiny.request(u)])[0] for u in range(QUEUE + 1)]  # one may run
    time.sleep(0.2)
    with pytest.raises(QueueFullError):
        client.submit([tiny.request(9)])[0].result(WAIT)
    for f in held:
        f.cancel()  # the engine drops them: the queue has room again
    late = tiny.request(4)
    late.deadline = time.monotonic() + 0.3
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        state.wait(state.submit(late), late.deadline)
    assert time.monotonic() - started < 2.0
    engine.batcher.gate.set()
    assert results(client.submit([tiny.request(5)]))[0].version == 1
    assert client.pending() == 0


def test_a_dead_engine_is_unavailable_at_once_until_a_new_one_binds(tiny, repo, split, addresses):
    engine, loop, client = split
    engine.batcher.gate.clear()
    waiting = client.submit([tiny.request(0)])[0]  # no deadline: only the engine's death ends it
    time.sleep(0.2)
    loop.stop()
    loop.close()  # the engine process is gone
    started = time.monotonic()
    with pytest.raises(UnavailableError):
        waiting.result(ENGINE_TIMEOUT_S + WAIT)
    assert time.monotonic() - started < 1.0 < ENGINE_TIMEOUT_S  # the disconnect, not the pings
    assert not client.ready
    with pytest.raises(UnavailableError):
        client.submit([tiny.request(1)])
    with pytest.raises(UnavailableError):
        client.info()

    fresh = start_engine(repo, BatchPolicy(8, 0.0, 2))  # the parent restarts the engine
    again = EngineLoop(fresh, *addresses)
    again.start()
    try:
        assert client.wait_ready(WAIT)
        want = results(fresh.submit([tiny.request(2)]))[0]
        got = results(client.submit([tiny.request(2)]))[0]
        assert got.item_ids.tolist() == want.item_ids.tolist()
    finally:
        fresh.batcher.stop(drain=False, timeout=WAIT)
        again.stop()
        again.close()
    with pytest.raises((UnavailableError, FutureTimeout)):
        client.submit([tiny.request(3)])[0].result(ENGINE_TIMEOUT_S + WAIT)
