"""A thread a server starts computes with the process's intra-op thread count, not OpenMP's
default of every core (``common/torch_threads.py``): the batcher's worker and the gRPC handler
pool's threads take it when they start."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from common.torch_threads import use_process_threads
from serving.engine.batching import BatchPolicy, DynamicBatcher
from serving.types import RecRequest


def omp_threads() -> int:
    """OpenMP's thread count for the calling thread, from the libgomp torch loaded: what an MKL
    matmul called here starts (torch's own parallel loops set it per thread; MKL does not)."""
    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not gomp.exists():
        pytest.skip("this torch build has no libgomp of its own")
    return int(ctypes.CDLL(str(gomp)).omp_get_max_threads())


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def in_thread(fn: Callable[[], int], first: Callable[[], None] | None = None) -> int:
    out: list[int] = []

    def run() -> None:
        if first is not None:
            first()
        out.append(fn())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: OpenMP's default is 1")
def test_a_new_thread_takes_the_process_count_only_when_told(one_thread):
    assert omp_threads() == 1
    assert in_thread(omp_threads) > 1  # OpenMP's per-thread default: why the helper exists
    assert in_thread(omp_threads, use_process_threads) == 1


def test_pools_and_the_batcher_compute_with_the_process_count(one_thread):
    with ThreadPoolExecutor(1, initializer=use_process_threads) as pool:
        assert pool.submit(omp_threads).result() == 1
    batcher = DynamicBatcher(
        BatchPolicy(max_batch_size=4, max_queue_delay_s=0.0, max_queue_size=0),
        lambda reqs: [omp_threads() for _ in reqs],
    )
    try:
        none = np.zeros(0, dtype=np.int64)
        req = RecRequest(history=none, categorical=none, dense=np.zeros(0, np.float32), k=1)
        assert batcher.submit(req).result(timeout=30) == 1
    finally:
        batcher.stop()
