"""Load on a local cluster for fault tests: a thread sending Recommend calls back to back, each
recorded with when it ended, how long it took, its status, partial flag and missing shards, and
whether its ids are right (:meth:`Load.right`: a partial answer is checked too, not only
flagged)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from retrieval.index.split import shard_of
from serving.protos import recommend_pb2_grpc

USERS = 8


@dataclass(frozen=True)
class Answer:
    ended: float
    """``time.monotonic()`` when it came back."""
    latency: float
    code: str
    """``OK`` or the gRPC status name."""
    partial: bool
    missing: tuple[str, ...]
    right: bool
    """:meth:`Load.right` of its ids."""


class Load:
    """``with Load(address, tiny, model, shards) as load:`` calls until the block ends (at most
    ``max_calls``); ``timeout_s`` is each call's gRPC deadline."""

    def __init__(
        self,
        address: str,
        tiny,  # support.tiny_model.Tiny
        model,
        shards: int,
        k: int = 20,
        timeout_s: float = 5.0,
        max_calls: int = 20_000,
    ):
        self.channel = grpc.insecure_channel(address)
        self.stub = recommend_pb2_grpc.RecommenderStub(self.channel)
        self.tiny, self.k, self.timeout_s, self.max_calls = tiny, k, timeout_s, max_calls
        self.shards = shards
        self.want = [[int(i) for i in row] for row in tiny.expected(model, np.arange(USERS), k)[0]]
        self.seen: list[Answer] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-load", daemon=True)

    def right(self, user: int, ids: list[int], missing: tuple[str, ...]) -> bool:
        """Whole: the unsharded model's ids. Partial: only items of the shards that answered,
        beginning with the unsharded answer's items of those shards, in its order (their top-K
        holds those; what follows them is theirs to rank)."""
        want = self.want[user]
        if not missing:
            return ids == want
        gone = torch.tensor([int(m.split("-")[1]) for m in missing])
        kept = ~torch.isin(shard_of(torch.tensor(want), self.shards), gone)
        head = [i for i, keep in zip(want, kept.tolist(), strict=True) if keep]
        held = not torch.isin(shard_of(torch.tensor(ids), self.shards), gone).any()
        return bool(held) and ids[: len(head)] == head and len(ids) == len(want)

    def _run(self) -> None:
        u = 0
        while not self._stop.is_set() and len(self.seen) < self.max_calls:
            start = time.monotonic()
            try:
                res = self.stub.Recommend(
                    self.tiny.message(u % USERS, self.k), timeout=self.timeout_s
                )
                missing = tuple(res.missing)
                right = self.right(u % USERS, list(res.item_ids), missing)
                row = ("OK", res.partial, missing, right)
            except grpc.RpcError as e:
                row = (e.code().name, False, (), False)
            end = time.monotonic()
            self.seen.append(Answer(end, end - start, *row))
            u += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.channel.close()

    def between(self, start: float, end: float) -> list[Answer]:
        return [a for a in self.seen if start <= a.ended <= end]

    def wait_whole(self, timeout: float, n: int = 3) -> float | None:
        """Until the last ``n`` answers are whole and right: when that happened (None: not
        within ``timeout`` s)."""
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            last = self.seen[-n:]
            if len(last) == n and all(a.code == "OK" and not a.partial and a.right for a in last):
                return last[0].ended
            time.sleep(0.02)
        return None

    def wait_count(self, n: int, timeout: float) -> None:
        until = time.monotonic() + timeout
        mark = len(self.seen)
        while len(self.seen) < mark + n:
            assert time.monotonic() < until, f"fewer than {n} answers in {timeout} s"
            time.sleep(0.02)
