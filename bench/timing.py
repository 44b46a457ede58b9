"""Timing helpers shared by the benchmarks: thread pinning, batched throughput, single-query latency.

The fairness rules from ``/work/shared/ANCHORS.md`` live here so every system is measured the same
way: equal thread counts for faiss and torch, a warm-up call first, the median of several runs for
batched throughput, and the p50 over many one-query calls for latency.

Example::

    set_threads(2)
    ids, median_s, runs_s = time_batched(lambda: index.search(q, 100), repeats=3)
    qps = len(q) / median_s
    p50_ms, p99_ms = time_single(lambda i: index.search(q[i : i + 1], 100), n=200)
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def set_threads(n: int) -> None:
    """Give faiss (OpenMP) and torch (intra-op pool) the same number of threads."""
    import faiss
    import torch

    faiss.omp_set_num_threads(n)
    torch.set_num_threads(n)


def time_batched(
    fn: Callable[[], T], repeats: int = 3, warmup: int = 1
) -> tuple[T, float, list[float]]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed.

    Returns ``(result of the first call, median seconds, every timed run in seconds)``; the result
    is what recall is computed from, so recall and speed come from the same code path.
    """
    assert repeats >= 1 and warmup >= 0
    result = fn()
    for _ in range(warmup - 1):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return result, statistics.median(runs), runs


def time_single(fn: Callable[[int], object], n: int = 200, warmup: int = 10) -> tuple[float, float]:
    """Call ``fn(i)`` for query ``i`` in ``0..n-1`` one at a time; return ``(p50 ms, p99 ms)``."""
    assert n >= 1
    for i in range(min(warmup, n)):
        fn(i)
    lat_ms = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        lat_ms.append((time.perf_counter() - t0) * 1e3)
    lat_ms.sort()
    return statistics.median(lat_ms), lat_ms[min(n - 1, round(0.99 * (n - 1)))]


def stopwatch() -> Callable[[], float]:
    """``elapsed = stopwatch(); ...; seconds = elapsed()``."""
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


def busy_s() -> float:
    """CPU seconds the whole machine has been busy (``/proc/stat``; 0.0 where unavailable)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def percentiles(lat_ms: list[float]) -> tuple[float, float]:
    """(p50, p99) in ms of single-request latencies (nan when empty)."""
    if not lat_ms:
        return float("nan"), float("nan")
    s = sorted(lat_ms)
    return statistics.median(s), s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def int_list(text: str) -> list[int]:
    """argparse type: ``"1,2,4"`` -> ``[1, 2, 4]``; every value must be >= 1."""
    import argparse

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def pid_cpu_s(pid: int) -> float | None:
    """CPU seconds so far (user + system, ``/proc/<pid>/stat``) of ``pid``; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pids: set[int], groups: set[int]) -> float:
    """CPU seconds so far of the live processes in ``pids`` or in the process groups ``groups``."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(entry.name) in pids or int(fields[2]) in groups:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class OtherLoad:
    """Share of the machine's CPU used by *other* processes between ``start()`` and ``stop()``.

    Benchmarks here share two cores with other sessions' compiles and tests; a point measured while
    others were busy is suspect. Reads ``/proc/stat`` (all CPUs) minus the run's own CPU time: this
    process, plus ``pids`` and the process groups ``groups`` when the run has more processes
    (a load generator, a server). Returns 0.0 where ``/proc/stat`` is unavailable.
    """

    def __init__(self, pids: set[int] | None = None, groups: set[int] | None = None) -> None:
        self.pids = (pids or set()) - {os.getpid()}
        self.groups = groups or set()
        self._t0 = self._busy0 = self._own0 = 0.0

    def _own_s(self) -> float:
        t = os.times()
        others = proc_cpu_s(self.pids, self.groups) if self.pids or self.groups else 0.0
        return t.user + t.system + others

    def start(self) -> None:
        self._t0, self._busy0, self._own0 = time.perf_counter(), busy_s(), self._own_s()

    def stop(self) -> float:
        wall = time.perf_counter() - self._t0
        others = (busy_s() - self._busy0) - (self._own_s() - self._own0)
        return max(0.0, others) / max(wall * (os.cpu_count() or 1), 1e-9)


def cell(x: float | None, fmt: str) -> str:
    """A table cell: ``x`` formatted, or an em dash for None / NaN (a case that did not run)."""
    return "—" if x is None or x != x else format(x, fmt)
