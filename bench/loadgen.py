"""The closed-loop gRPC load generator the serving benchmarks share (run it in a process of its
own, e.g. a spawned ``ProcessPoolExecutor`` worker, so it does not share the server's GIL).

    stats = closed_loop("127.0.0.1:8001", RecommenderStub_Recommend, requests, 8, 1.0, 5.0)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from timing import percentiles

from loadtest.workload import OWN_CONNECTION

Send = Callable[..., Any]
"""``send(request, timeout=...) -> response``: a bound unary stub method."""


def ready() -> int:
    """Run once in the load generator process so its start-up is not timed; returns its pid."""
    return os.getpid()


def closed_loop(
    address: str,
    make_send: Callable[[grpc.Channel], Send],
    requests: list[Any],
    concurrency: int,
    warmup_s: float,
    seconds: float,
    partial: Callable[[Any], bool] = lambda _response: False,
) -> dict[str, Any]:
    """``concurrency`` threads, each with its own channel, send the next request as soon as the
    last one answers. Counts the calls that end in the ``seconds`` after ``warmup_s``: q/s,
    p50/p99 of the answered calls, partial answers (``partial(response)``), errors by gRPC code."""
    start = time.perf_counter() + 0.3  # every thread connected before the clock starts
    measure_from, end = start + warmup_s, start + warmup_s + seconds
    records: list[list[tuple[float, float, bool, str]]] = [[] for _ in range(concurrency)]

    def client(c: int) -> None:
        # each client its own TCP connection, as real clients are (and as a group of server
        # processes sharing a port needs: the kernel spreads connections, not calls)
        with grpc.insecure_channel(address, options=[OWN_CONNECTION]) as channel:
            send = make_send(channel)
            grpc.channel_ready_future(channel).result(timeout=30)
            while time.perf_counter() < start:
                time.sleep(0.001)
            i = c
            while (t0 := time.perf_counter()) < end:
                try:
                    was_partial, code = partial(send(requests[i % len(requests)], timeout=60)), "OK"
                except grpc.RpcError as e:
                    was_partial, code = False, e.code().name
                records[c].append((t0, time.perf_counter(), was_partial, code))
                i += concurrency

    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for rs in records for r in rs if measure_from <= r[1] <= end]
    ok = [r for r in done if r[3] == "OK"]
    errors: dict[str, int] = {}
    for r in done:
        if r[3] != "OK":
            errors[r[3]] = errors.get(r[3], 0) + 1
    p50, p99 = percentiles([(r[1] - r[0]) * 1e3 for r in ok])
    return {
        "requests": len(done),
        "qps": len(ok) / seconds,
        "p50_ms": p50,
        "p99_ms": p99,
        "partial": sum(r[2] for r in ok),
        "errors": errors,
    }
