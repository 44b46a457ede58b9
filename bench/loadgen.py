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
from timing import percentiles, pid_cpu_s

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
    cpu_pids: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``concurrency`` threads, each with its own channel, send the next request as soon as the
    last one answers. Counts the calls that end in the ``seconds`` after ``warmup_s``: q/s,
    p50/p99 of the answered calls, partial answers (``partial(response)``), errors by gRPC code.

    ``cpu_pids`` (name -> pid): also ``cpu_s``, the CPU seconds each of those processes and this
    load generator (``"loadgen"``) spent in exactly that window (``/proc/<pid>/stat`` read at its
    start and end by a thread of this process; None for a process that exited in between)."""
    start = time.perf_counter() + 0.3  # every thread connected before the clock starts
    measure_from, end = start + warmup_s, start + warmup_s + seconds
    records: list[list[tuple[float, float, bool, str]]] = [[] for _ in range(concurrency)]
    watched = {**(cpu_pids or {}), "loadgen": os.getpid()}
    cpu: list[dict[str, float | None]] = []

    def cpu_meter() -> None:
        for at in (measure_from, end):
            time.sleep(max(0.0, at - time.perf_counter()))
            cpu.append({name: pid_cpu_s(pid) for name, pid in watched.items()})

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
    if cpu_pids is not None:
        threads.append(threading.Thread(target=cpu_meter))
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
    out = {
        "requests": len(done),
        "qps": len(ok) / seconds,
        "p50_ms": p50,
        "p99_ms": p99,
        "partial": sum(r[2] for r in ok),
        "errors": errors,
    }
    if cpu_pids is not None:
        out["cpu_s"] = cpu_window(*cpu)
    return out


def cpu_window(
    before: dict[str, float | None], after: dict[str, float | None]
) -> dict[str, float | None]:
    """CPU seconds per process between two readings (None where either reading is missing)."""
    return {
        name: None if (b := before[name]) is None or (a := after.get(name)) is None else a - b
        for name in before
    }
