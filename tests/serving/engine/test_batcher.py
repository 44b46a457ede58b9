"""DynamicBatcher: admission, gating, deadlines, draining, errors (no model: an echo batch)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from serving.engine.batching import (
    BatchPolicy,
    DeadlineExceededError,
    DynamicBatcher,
    QueueFullError,
    UnavailableError,
)
from serving.types import RecRequest

WAIT = 10.0  # generous: only a broken batcher takes this long


def req(i: int, deadline: float | None = None) -> RecRequest:
    z = np.zeros(0, np.int64)
    return RecRequest(z, z, np.zeros(0, np.float32), k=i, deadline=deadline)


class Echo:
    """run_batch that answers each request with its k and records the batches."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, reqs: list[RecRequest]) -> list[object]:
        self.batches.append([r.k for r in reqs])
        return [ValueError(f"k: {r.k}") if r.k < 0 else r.k for r in reqs]


def gated(policy: BatchPolicy, run=None) -> tuple[DynamicBatcher, Echo]:
    echo = run or Echo()
    b = DynamicBatcher(policy, echo, start=False)
    b.gate.clear()  # closed before the worker exists: it forms no batch until opened
    b.start()
    return b, echo


def test_queue_overflow_rejects_exactly_the_overflow():
    b, echo = gated(BatchPolicy(max_batch_size=4, max_queue_delay_s=0.0, max_queue_size=10))
    accepted, refused = [], 0
    for i in range(13):
        try:
            accepted.append(b.submit(req(i)))
        except QueueFullError as e:
            assert "max_queue_size=10" in str(e)
            refused += 1
    assert (len(accepted), refused, b.waiting) == (10, 3, 10)
    b.gate.set()
    assert [f.result(WAIT) for f in accepted] == list(range(10))
    assert all(len(batch) <= 4 for batch in echo.batches)
    assert [k for batch in echo.batches for k in batch] == list(range(10))
    assert b.submit(req(99)).result(WAIT) == 99  # room again
    assert b.stop(timeout=WAIT)


def test_expired_requests_complete_with_deadline_exceeded_and_never_run():
    b, echo = gated(BatchPolicy(8, 0.0, 0))
    soon = b.submit(req(1, deadline=time.monotonic() + 0.05))
    later = b.submit(req(2, deadline=time.monotonic() + 60))
    free = b.submit(req(3))
    time.sleep(0.1)
    b.gate.set()
    with pytest.raises(DeadlineExceededError, match=r"^deadline"):
        soon.result(WAIT)
    assert (later.result(WAIT), free.result(WAIT)) == (2, 3)
    assert echo.batches == [[2, 3]]
    b.stop(timeout=WAIT)


def test_a_full_batch_goes_at_once_and_a_lone_request_waits_for_the_delay():
    b, _ = gated(BatchPolicy(4, max_queue_delay_s=30.0, max_queue_size=0))
    futs = [b.submit(req(i)) for i in range(4)]
    b.gate.set()
    assert [f.result(WAIT) for f in futs] == [0, 1, 2, 3]
    b.stop(timeout=WAIT)

    b = DynamicBatcher(BatchPolicy(4, max_queue_delay_s=0.2, max_queue_size=0), Echo())
    start = time.monotonic()
    assert b.submit(req(7)).result(WAIT) == 7
    assert time.monotonic() - start >= 0.19
    b.stop(timeout=WAIT)


def test_errors_reach_only_their_requests_and_a_failed_batch_fails_all():
    b, _ = gated(BatchPolicy(8, 0.0, 0))
    ok, bad = b.submit(req(1)), b.submit(req(-1))
    b.gate.set()
    assert ok.result(WAIT) == 1
    with pytest.raises(ValueError, match=r"^k"):
        bad.result(WAIT)
    b.stop(timeout=WAIT)

    calls = []

    def explode(reqs):
        calls.append(len(reqs))
        if len(calls) == 1:
            raise RuntimeError("model fell over")
        return [r.k for r in reqs]

    b = DynamicBatcher(BatchPolicy(8, 0.0, 0), explode, start=False)
    b.gate.clear()
    b.start()
    first = [b.submit(req(i)) for i in range(3)]
    b.gate.set()
    for f in first:
        with pytest.raises(RuntimeError, match="fell over"):
            f.result(WAIT)
    assert b.submit(req(5)).result(WAIT) == 5  # the worker survived
    b.stop(timeout=WAIT)


def test_cancelled_requests_leave_the_queue_without_running():
    b, echo = gated(BatchPolicy(8, 0.0, 0))
    a, c = b.submit(req(1)), b.submit(req(2))
    assert a.cancel()
    b.gate.set()
    assert c.result(WAIT) == 2
    assert echo.batches == [[2]]
    b.stop(timeout=WAIT)


def test_stop_drains_without_waiting_for_the_delay_then_refuses():
    b, _ = gated(BatchPolicy(8, max_queue_delay_s=60.0, max_queue_size=0))
    futs = [b.submit(req(i)) for i in range(3)]
    start = time.monotonic()
    assert b.stop(drain=True, timeout=WAIT)  # opens the gate itself
    assert time.monotonic() - start < 5
    assert [f.result(0) for f in futs] == [0, 1, 2]
    with pytest.raises(UnavailableError):
        b.submit(req(4))


def test_stop_without_drain_fails_what_is_queued():
    b, echo = gated(BatchPolicy(8, 0.0, 0))
    futs = [b.submit(req(i)) for i in range(3)]
    assert b.stop(drain=False, timeout=WAIT)
    for f in futs:
        with pytest.raises(UnavailableError):
            f.result(0)
    assert echo.batches == []


def test_concurrent_submitters_each_get_their_own_answer():
    b = DynamicBatcher(BatchPolicy(16, 0.001, 0), Echo())
    results: dict[int, Future] = {}
    lock = threading.Lock()

    def client(base: int) -> None:
        for i in range(base, base + 100):
            f = b.submit(req(i))
            with lock:
                results[i] = f

    threads = [threading.Thread(target=client, args=(t * 1000,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(f.result(WAIT) == i for i, f in results.items())
    assert len(results) == 800
    assert b.stop(timeout=WAIT)


def test_on_batch_hears_each_requests_queue_wait():
    seen: list[list[float]] = []
    b = DynamicBatcher(BatchPolicy(8, 0.0, 0), Echo(), on_batch=seen.append, start=False)
    b.gate.clear()
    b.start()
    futs = [b.submit(req(i)) for i in range(3)]
    time.sleep(0.05)
    b.gate.set()
    for f in futs:
        f.result(WAIT)
    assert len(seen) == 1 and len(seen[0]) == 3 and min(seen[0]) >= 0.04
    b.stop(timeout=WAIT)


def test_a_cancelled_request_frees_its_place_in_a_full_queue():
    b, echo = gated(BatchPolicy(8, 0.0, max_queue_size=2))
    first, second = b.submit(req(1)), b.submit(req(2))
    with pytest.raises(QueueFullError):
        b.submit(req(3))
    assert first.cancel()
    third = b.submit(req(3))
    b.gate.set()
    assert (second.result(WAIT), third.result(WAIT)) == (2, 3)
    assert echo.batches == [[2, 3]]
    b.stop(timeout=WAIT)


def test_several_workers_run_batches_at_once_and_all_stop():
    inside, release = threading.Barrier(2, timeout=WAIT), threading.Event()

    def slow(reqs: list[RecRequest]) -> list[object]:
        inside.wait()  # both batches must be running together to pass this
        release.wait(WAIT)
        return [r.k for r in reqs]

    b = DynamicBatcher(BatchPolicy(1, 0.0, 0), slow, workers=2)
    futures = [b.submit(req(i)) for i in range(2)]
    release.set()
    assert [f.result(WAIT) for f in futures] == [0, 1]
    assert b.stop(timeout=WAIT)
    with pytest.raises(ValueError, match="workers"):
        DynamicBatcher(BatchPolicy(1, 0.0, 0), slow, workers=0)
