"""CUDA graphs of a search's fixed-shape part on a GPU: one launch instead of ~90.

A one-query search on a GPU is a few hundred microseconds of kernels behind ~90 kernel launches
of host time (probe, query quantization, grouping the pairs, the scan, top-K). A graph records
them once per (batch bucket, shape key, index state) and replays them as one launch:
:func:`run_graphed` pads the batch to its bucket (1, 2, 4, ... up to :data:`MAX_BATCH`), copies
its inputs (the queries, and a served request's excluded rows, their width bucketed by the
caller) into the graph's own, replays, and returns copies of the outputs.

Graphs are kept per index (a weak map: not in the module, so copies and saves never see them;
at most :data:`MAX_GRAPHS`) and keyed by
the index's tensors (storage and version), so a live update, a reload or a move records anew.
A capture that fails (an op that cannot be captured) is remembered and that key runs eagerly.
``RECSERVE_CUDA_GRAPHS=0`` turns graphs off. Inside a graph of the whole forward
(``retrieval/graphed_forward.py``: :func:`inside_whole_graph`) the search runs as it is: it is
recorded as part of that graph.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

GRAPHS_ENV = "RECSERVE_CUDA_GRAPHS"
MAX_BATCH = 32
"""Largest batch a graph records (larger batches are few launches per query anyway, and each
graph keeps its intermediate buffers)."""
MAX_GRAPHS = 16

Outputs = tuple[torch.Tensor, ...]


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph, or None: the capture failed, run eagerly
    inputs: tuple[torch.Tensor, ...] = ()
    outs: Outputs = ()
    lock: threading.Lock = field(default_factory=threading.Lock)


_CACHES: weakref.WeakKeyDictionary[Any, dict[Hashable, _Graph]] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


_WHOLE = threading.local()


@contextmanager
def inside_whole_graph() -> Iterator[None]:
    """This thread runs (or records) the whole forward's graph: :func:`run_graphed` calls its
    function directly meanwhile (a graph cannot be captured inside another's capture)."""
    before = getattr(_WHOLE, "on", False)
    _WHOLE.on = True
    try:
        yield
    finally:
        _WHOLE.on = before


def bucket(b: int) -> int:
    """The batch size a graph of ``b`` rows is recorded at: the next power of two."""
    return 1 << max(0, (b - 1).bit_length())


def _state(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((t.data_ptr(), t._version) for t in tensors)


def run_graphed(
    owner: Any,
    key: Hashable,
    fn: Callable[..., Outputs],
    inputs: tuple[torch.Tensor, ...],
    tensors: tuple[torch.Tensor, ...],
) -> Outputs:
    """``fn(*inputs)`` for batch inputs (``q [B, D]`` first, then e.g. excluded rows ``[B,
    S]``), replayed from a CUDA graph where it can be: ``fn`` must map them to outputs whose
    first dimension is the batch, with shapes fixed by ``key``, ``B`` and the inputs' other
    dimensions, reading only ``inputs`` and ``tensors`` (the index's buffers) on the GPU."""
    q = inputs[0]
    b = q.shape[0]
    if (
        q.device.type != "cuda"
        or b > MAX_BATCH
        or os.environ.get(GRAPHS_ENV) == "0"
        or getattr(_WHOLE, "on", False)
    ):
        return fn(*inputs)
    size = bucket(b)
    shapes = tuple((t.dtype, tuple(t.shape[1:])) for t in inputs)
    full_key = (key, size, shapes, _state(tensors))
    with _CACHES_LOCK:  # one capture at a time
        cache = _CACHES.setdefault(owner, {})
        entry = cache.get(full_key)
        if entry is None:
            if len(cache) >= MAX_GRAPHS:
                cache.clear()  # an old index state's graphs: their buffers go with them
            entry = cache[full_key] = _capture(fn, inputs, size)
    if entry.graph is None:
        return fn(*inputs)
    with entry.lock:  # one replay at a time: the inputs and outputs are the graph's own
        for buf, t in zip(entry.inputs, inputs, strict=True):
            buf[:b].copy_(t)
            if b < size:  # rows past the batch: any valid values, their outputs are dropped
                buf[b:].zero_()
        entry.graph.replay()
        return tuple(o[:b].clone() for o in entry.outs)


def _capture(fn: Callable[..., Outputs], inputs: tuple[torch.Tensor, ...], size: int) -> _Graph:
    """Warms ``fn`` up on a side stream (kernels compiled, host caches filled), then records it
    reading buffers of ``size`` rows (the batch's first, zeros after)."""
    q = inputs[0]
    bufs = tuple(t.new_zeros((size, *t.shape[1:])) for t in inputs)
    for buf, t in zip(bufs, inputs, strict=True):
        buf[: t.shape[0]].copy_(t)
    try:
        side = torch.cuda.Stream(q.device)
        side.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*bufs)
        torch.cuda.current_stream(q.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads keep running their batches during the capture
        # (the default, "global", would fail their CUDA calls while this one records)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outs = fn(*bufs)
        return _Graph(graph, bufs, tuple(outs))
    except Exception as e:  # any capture failure: this key runs eagerly
        log.warning("CUDA graph capture failed, searching without one: %s", e)
        torch.cuda.synchronize(q.device)
        return _Graph(None)
