"""The served forward on a GPU as one CUDA graph per bucket: features -> tables -> tower ->
search (the plan decided on the device) -> scoring head -> top-K in one replay.

    batch on the host  --pinned staging, non_blocking-->  the graph's static inputs
    graph.replay()                                        the whole forward, no host read
    the graph's outputs --non_blocking-->  pinned host outputs  --one wait-->  the answer

A batch of ``B`` requests runs at its bucket (the next power of two, up to the batcher's
largest batch): rows past ``B`` repeat the first request (a valid request, whatever the model
checks) and their answers are dropped. The graph's shapes are fixed by its key: the bucket,
``K`` (bucketed too: a graph answers the top ``bucket(K)``, at most the catalog, and the
first ``K`` of them are returned, as a batch's requests share its largest ``K``), the clause count, the history width, the seen width (bucketed, ``-1`` padded, which
excludes nothing more) and whether users are given (the seen store's rows). The key also
holds the index's buffers (storage and version), so an index written in place records anew.

Graphs are recorded at the runner's warm-up (a load or a reload) and, for a live update, by
the updated version's runner before it is swapped in (:meth:`GraphedForward.record_like`: the
buckets the served one had). A batch the graph cannot answer (a recall target, which is
planned on the host; live rows beside the main index; more rows than the largest bucket) runs
the model eagerly.

The capture is behind a seam (:data:`Recorder`): :func:`cuda_recorder` on a GPU, and on the
CPU :func:`eager_recorder`, which runs the recorded forward at each replay over the same static
buffers, so the CPU's tests check the bucketing, the padding and the re-recording.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from retrieval.features import UserBatch
from retrieval.index.cuda_graphs import bucket, inside_whole_graph

Outputs = tuple[torch.Tensor, torch.Tensor]
Recorder = Callable[[Callable[[], Outputs]], Callable[[], Outputs]]
"""``record(run) -> replay``: ``run`` computes the forward from the static inputs; ``replay()``
recomputes it (after new inputs were copied in) and returns its outputs."""

FIELDS = (
    "history",
    "categorical",
    "dense",
    "filter_masks",
    "filter_negate",
    "seen",
    "user",
    "filter_none",
)
"""The batch's fields a graph reads (a recall target is never graphed)."""


def eager_recorder(run: Callable[[], Outputs]) -> Callable[[], Outputs]:
    """The CPU's "graph": the forward run again at each replay, over the same buffers."""
    return run


def cuda_recorder(run: Callable[[], Outputs]) -> Callable[[], Outputs]:
    """Warms ``run`` up on a side stream (kernels compiled, host caches filled), then records it
    as one CUDA graph; the replay returns the graph's own output tensors."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a server's other threads keep running while this one records
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outs = run()

    def replay() -> Outputs:
        graph.replay()
        return outs

    return replay


@dataclass
class _Entry:
    staged: dict[str, torch.Tensor]  # [size, ...] on the host (pinned on a GPU machine)
    inputs: dict[str, torch.Tensor]  # [size, ...] the graph's static inputs, on the device
    replay: Callable[[], Outputs]
    answers: tuple[torch.Tensor, torch.Tensor]  # [size, k] on the host (pinned likewise)
    lock: threading.Lock = field(default_factory=threading.Lock)


class GraphedForward:
    """A served model's forward, replayed per bucket (module docstring). ``model``: on the
    device (its index on the ``"device"`` backend); ``max_batch``: the batcher's largest batch;
    ``recorder``: the capture (default: CUDA graphs on a GPU, eager on the CPU)."""

    def __init__(self, model: Any, max_batch: int, recorder: Recorder | None = None) -> None:
        self.model = model
        self.device: torch.device = model.index.centroids.device
        self.max_bucket = bucket(max_batch)
        gpu = self.device.type == "cuda"
        self.recorder = recorder or (cuda_recorder if gpu else eager_recorder)
        self.records = 0
        """Graphs recorded so far (a test reads it)."""
        self._entries: dict[Hashable, _Entry] = {}
        self._lock = threading.Lock()

    def accepts(self, batch: UserBatch) -> bool:
        """Whether a graph answers ``batch`` (else :meth:`__call__` runs the model eagerly)."""
        index = self.model.index
        live = index.live is not None and index.live.size > 0
        return (
            index.executor.backend == "device"
            and batch.recall_target is None
            and batch.filter_verify is None  # exact clauses: eager (their atoms' shapes vary)
            and not live
            and batch.size <= self.max_bucket
        )

    def k_of(self, k: int) -> int:
        """The ``K`` a graph of requests asking for ``k`` answers (its bucket, in the catalog)."""
        return max(k, min(bucket(k), self.model.index.ntotal))

    def key(self, batch: UserBatch, k: int) -> Hashable:
        """What fixes a graph's shapes for ``batch`` and ``k`` (the module docstring)."""
        seen = None if batch.seen is None else bucket(batch.seen.shape[1])
        return (
            bucket(batch.size),
            k,
            tuple(batch.filter_masks.shape[1:]),
            batch.history.shape[1],
            seen,
            batch.user is not None,
            batch.filter_none is not None,
            self._index_state(),
        )

    def __call__(self, batch: UserBatch, k: int) -> Outputs:
        """``batch`` (host tensors, from admitted requests) -> ``(ids [B, k], scores [B, k])``
        on the host, from the graph of its bucket (recorded on first use)."""
        if not self.accepts(batch):
            ids, scores = self.model(batch.to(self.device), k, checked=True)
            return ids.cpu(), scores.cpu()
        top = self.k_of(k)
        entry = self._entry(batch, top)
        b = batch.size
        with entry.lock:  # the staging buffers and the graph's tensors are its own
            for name, t in _fields(batch).items():
                _stage(entry.staged[name], t)
                entry.inputs[name].copy_(entry.staged[name], non_blocking=True)
            outs = entry.replay()
            for host, out in zip(entry.answers, outs, strict=True):
                host.copy_(out, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the answer's copy back
            return entry.answers[0][:b, :k].clone(), entry.answers[1][:b, :k].clone()

    def record_like(self, other: GraphedForward) -> None:
        """Records, for this (updated or reloaded) model, the graphs ``other`` holds: each from
        the batch last staged in it (a valid batch of its bucket)."""
        with other._lock:
            entries = list(other._entries.items())
        for key, entry in entries:
            batch = _batch_of(entry.staged)
            if self.accepts(batch):
                self._entry(batch, key[1])  # type: ignore[index]

    def _entry(self, batch: UserBatch, k: int) -> _Entry:
        key = self.key(batch, k)
        with self._lock:  # one capture at a time
            entry = self._entries.get(key)
            if entry is None:
                if any(e[-1] != key[-1] for e in self._entries):  # type: ignore[index]
                    self._entries.clear()  # an old index state's graphs: free their buffers
                entry = self._entries[key] = self._record(batch, k, key[0])  # type: ignore[index]
                self.records += 1
        return entry

    def _record(self, batch: UserBatch, k: int, size: int) -> _Entry:
        pin = self.device.type == "cuda"
        staged = {}
        for name, t in _fields(batch).items():
            staged[name] = torch.empty((size, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
            _stage(staged[name], t)
        inputs = {name: t.to(self.device) for name, t in staged.items()}
        static = _batch_of(inputs)
        model = self.model

        def run() -> Outputs:
            with inside_whole_graph():  # the index's own graphs stay out of this one
                ids, scores = model(static, k, checked=True)
            return ids, scores

        replay = self.recorder(run)
        answers = tuple(
            torch.empty((size, k), dtype=dt, pin_memory=pin) for dt in (torch.int64, torch.float32)
        )
        return _Entry(staged, inputs, replay, answers)  # type: ignore[arg-type]

    def _index_state(self) -> tuple[tuple[int, int], ...]:
        """The index's buffers as (storage, version): a new index or an in-place write."""
        return tuple((b.data_ptr(), _version(b)) for b in self.model.index.buffers())


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place write count (an inference tensor keeps none: 0)."""
    try:
        return int(t._version)
    except RuntimeError:
        return 0


def _fields(batch: UserBatch) -> dict[str, torch.Tensor]:
    """The graphed fields of ``batch`` that it has; the seen ids padded to their bucket."""
    out = {name: getattr(batch, name) for name in FIELDS if getattr(batch, name) is not None}
    if "seen" in out:
        s = out["seen"]
        out["seen"] = torch.nn.functional.pad(s, (0, bucket(s.shape[1]) - s.shape[1]), value=-1)
    return out


def _stage(buf: torch.Tensor, t: torch.Tensor) -> None:
    """``t [B, ...]`` into ``buf [size, ...]``: rows past ``B`` repeat its first (a valid
    request; their answers are dropped)."""
    b = t.shape[0]
    buf[:b].copy_(t)
    if b < buf.shape[0]:
        buf[b:].copy_(t[:1].expand_as(buf[b:]))


def _batch_of(tensors: dict[str, torch.Tensor]) -> UserBatch:
    """A batch of these fields (the absent ones None)."""
    return UserBatch(**{name: tensors.get(name) for name in FIELDS})  # type: ignore[arg-type]
