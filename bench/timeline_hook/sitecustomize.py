"""Timestamps at fixed points of a served request, for ``bench/timeline.py``.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that holds
one. ``bench/timeline.py`` puts this folder on ``PYTHONPATH`` of the servers it starts and sets
``RECSERVE_TIMELINE_DIR``; then, as each module named in :data:`POINTS` is imported, the
functions listed for it are wrapped, and every call records ``<monotonic ns> <thread>
<function>:in`` and ``:out``. Each process writes its records to ``DIR/<pid>.txt``, in blocks
and at exit. Without the variable this file does nothing. No product code changes.

``time.monotonic_ns`` is one clock for every process on a host, so the records of the load
generator's server, the router and the shards merge into one timeline.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

POINTS: dict[str, list[str]] = {
    # the gRPC front end and the batcher (recserve serve, the router)
    "serving.frontends.recommend_grpc": ["RecommendServicer.Recommend", "render_recommend"],
    "serving.engine.state": ["ServingState.submit", "ServingState.wait"],
    "serving.engine.batching": ["DynamicBatcher._execute"],
    "serving.engine.runner": ["ModelRunner.run", "ModelRunner._batch", "ModelRunner.forward"],
    # the model
    "retrieval.model": ["RetrievalModel.user_vectors", "RetrievalModel.rank"],
    "retrieval.index.ivf": ["IVFIndex.execute", "IVFIndex.item_candidates"],
    # the router's round and the shard's answer
    "serving.sharding.router": ["RouterRunner.forward", "first_round"],
    "serving.sharding.shard_client": ["ShardClient.search", "ShardClient.call"],
    "serving.sharding.wire": [
        "encode_request",
        "decode_request",
        "encode_response",
        "decode_response",
    ],
    "serving.sharding.shard_server": ["ShardServicer.Search"],
}

BLOCK = 4096
"""Records kept in memory before they are appended to the file."""


class _Recorder:
    def __init__(self, directory: str):
        self.path = os.path.join(directory, f"{os.getpid()}.txt")
        self.records: list[tuple[int, int, str]] = []
        self.lock = threading.Lock()
        atexit.register(self.flush)

    def add(self, name: str) -> None:
        self.records.append((time.monotonic_ns(), threading.get_ident(), name))
        if len(self.records) >= BLOCK:
            self.flush()

    def flush(self) -> None:
        with self.lock:
            records, self.records = self.records, []
            with open(self.path, "a") as f:
                f.writelines(f"{t} {tid} {name}\n" for t, tid, name in records)


def _timed(fn: Callable[..., Any], name: str, rec: _Recorder) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        rec.add(name + ":in")
        try:
            return fn(*args, **kwargs)
        finally:
            rec.add(name + ":out")

    return timed


def _wrap(module: ModuleType, names: Sequence[str], rec: _Recorder) -> None:
    for qualname in names:
        owner: Any = module
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, _timed(getattr(owner, attr), qualname, rec))


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`POINTS` with the other finders, and wraps their functions
    once the module has run."""

    def __init__(self, rec: _Recorder):
        self.rec = rec

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in POINTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module: ModuleType, run: Any = run) -> None:
                    run(module)
                    _wrap(module, POINTS[fullname], self.rec)

                spec.loader.exec_module = exec_module
                return spec
        return None


if os.environ.get("RECSERVE_TIMELINE_DIR"):
    sys.meta_path.insert(0, _Finder(_Recorder(os.environ["RECSERVE_TIMELINE_DIR"])))
