"""The router's client of its document shard servers: a channel to every replica of every shard,
and the scatter/gather of one search round (``ShardClient.search``).

One round sends the request to every shard in parallel under one deadline and returns the
answers and the errors by shard; a shard still silent at the deadline is an error
(DEADLINE_EXCEEDED), never a hang. With replicas, a replica that fails fast fails over to the
next one, and a slow one gets a twin call to the next replica (hedging: after ``hedge_after_ms``,
or adaptively after the p95 of the shard's recent answers; the first answer wins). A replica that
fails calls in a row is ejected from the rotation and probed back (``serving/sharding/health.py``);
the losing calls of a round are left to finish within the deadline, so that each replica's
outcome is known.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from common.grpc_util import ClientAuth, open_channel
from common.torch_threads import use_process_threads
from serving.protos import shard_pb2 as pb
from serving.protos import shard_pb2_grpc as pb_grpc
from serving.sharding.config import RouterConfig
from serving.sharding.health import FAILURE_CODES, Change, Ejection, LatencyWindow
from serving.sharding.router_metrics import RouterMetrics
from serving.sharding.shard_server import GRPC_OPTIONS

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = 2.0
CALL_THREADS_PER_REPLICA = 8
"""Search calls in flight per replica at most: batches in flight (default 4), their hedges and
probes; more wait for a thread (and their deadline keeps running)."""
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    # a restarted shard is reachable again within a second, not after minutes of backoff
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


@dataclass
class _ShardCall:
    """One shard's call of one round: its replicas tried in turn, hedged at ``hedge_at``."""

    shard: int
    order: list[str]  # replica addresses, in the order to try
    healthy: int  # the first ``healthy`` of them are in rotation: only those get twins
    hedge_at: float  # monotonic time of the twin call; inf: none (or sent)
    inline: bool = False  # calls run in the caller's thread (never hedged; see search)
    futures: list[Any] = field(default_factory=list)
    last_error: str = ""
    last_code: str = ""

    def launch(
        self,
        client: ShardClient,
        request: pb.SearchRequest,
        timeout: float,
        wake: threading.Event,
        twin: bool = False,
    ) -> bool:
        """Calls the next untried replica (for a ``twin``: one in rotation); False when none
        is left."""
        if len(self.futures) >= (self.healthy if twin else len(self.order)):
            return False
        address = self.order[len(self.futures)]
        self.futures.append(
            client.call(self.shard, address, request, timeout, wake, inline=self.inline)
        )
        return True

    def answer(self) -> Any | None:
        """The first successful answer, if any call finished with one."""
        for f in self.futures:
            if f.done() and not f.cancelled() and f.exception() is None:
                return f.result()
        return None

    def all_failed(self) -> bool:
        """Every call so far finished without an answer (records the last error)."""
        for f in self.futures:
            if not f.done():
                return False
        for f in self.futures:
            err = f.exception() if not f.cancelled() else None
            if err is not None:
                self.last_code = err.code().name if hasattr(err, "code") else "UNKNOWN"
                self.last_error = err.details() if hasattr(err, "details") else str(err)
        return True


class ShardClient:
    """Channels to every replica of every shard; scatter/gather with deadlines, hedging and
    replica ejection."""

    def __init__(
        self,
        config: RouterConfig,
        model: str,
        registry: CollectorRegistry,
        upstream: ClientAuth | None = None,
    ):
        config.validate()
        self.config = config
        self.shards = config.shards
        addresses = sorted({a for replicas in self.shards for a in replicas})
        self._channels = {a: open_channel(a, CHANNEL_OPTIONS, upstream) for a in addresses}
        self._stubs = {a: pb_grpc.ShardStub(c) for a, c in self._channels.items()}
        # Calls are blocking stub calls on threads of our own: a gRPC future starts a new
        # channel-polling thread whenever its channel was idle (every call of a lone client),
        # a thread's start and a hand-off each; a blocking call polls in its own thread.
        self._pool = ThreadPoolExecutor(
            max_workers=CALL_THREADS_PER_REPLICA * len(addresses),
            thread_name_prefix="shard-call",
            initializer=use_process_threads,
        )
        self._turn = itertools.count()  # rotates which replica goes first
        self.metrics = RouterMetrics(model, registry)
        self._failing: set[int] = set()
        c = config
        self._lock = threading.Lock()  # the health state: rounds and gRPC callbacks share it
        self._health = Ejection(
            self.shards, c.eject_after_failures, c.eject_base_ms / 1e3, c.eject_max_ms / 1e3
        )
        self._latency = [
            LatencyWindow(c.hedge_min_ms / 1e3, c.hedge_max_ms / 1e3) for _ in self.shards
        ]
        for s, replicas in enumerate(self.shards):
            self.metrics.in_rotation.labels(model, str(s)).set(len(replicas))

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def stub(self, address: str) -> pb_grpc.ShardStub:
        """The ``Shard`` stub of one replica (live updates call every replica themselves)."""
        return self._stubs[address]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self._channels.values():
            c.close()

    # ---- versions and identity --------------------------------------------------------------
    def infos(self, timeout: float = INFO_TIMEOUT_S) -> dict[str, pb.InfoResponse]:
        """``Info`` of every replica that answers within ``timeout`` s (address -> answer)."""
        calls = {  # wait_for_ready: a channel still connecting (a busy machine) is no answer yet
            a: s.Info.future(pb.InfoRequest(), timeout=timeout, wait_for_ready=True)
            for a, s in self._stubs.items()
        }
        out = {}
        for a, f in calls.items():
            try:
                out[a] = f.result()
            except grpc.RpcError:
                continue
        return out

    def common_versions(self, model: str) -> list[int]:
        """Versions every answering replica holds, after checking each one is the shard its
        place in the config says (refuses another model or shard layout: ``ValueError``).
        Empty while a shard has no answering replica: nothing is known to be whole there."""
        infos = self.infos()
        common: set[int] | None = None
        for i, replicas in enumerate(self.shards):
            if not any(a in infos for a in replicas):
                return []
            for a in replicas:
                info = infos.get(a)
                if info is None:
                    continue
                if info.model != model or info.shard != i or info.num_shards != self.num_shards:
                    raise ValueError(
                        f"router.shards[{i}]: {a} serves shard {info.shard}/{info.num_shards} of "
                        f"{info.model!r}; expected shard {i}/{self.num_shards} of {model!r}"
                    )
                common = set(info.versions) if common is None else common & set(info.versions)
        return sorted(common or ())

    # ---- search -----------------------------------------------------------------------------
    def timeout(self, deadline: float | None) -> float:
        """Seconds a round may take: the shard deadline, cut to the batch's own deadline."""
        t = self.config.shard_deadline_ms / 1000.0
        if deadline is not None:
            t = min(t, max(deadline - time.monotonic(), 0.001))
        return t

    def hedge_after(self, shard: int) -> float:
        """Seconds after which a call to ``shard`` gets a twin (inf: never)."""
        if self.config.hedge_after_ms > 0:
            return self.config.hedge_after_ms / 1000.0
        if self.config.hedge == "off" or len(self.shards[shard]) < 2:
            return math.inf
        return self._latency[shard].hedge_after()

    def in_rotation(self, shard: int) -> int:
        with self._lock:
            return self._health.in_rotation(shard)

    def call(
        self,
        shard: int,
        address: str,
        request: pb.SearchRequest,
        timeout: float,
        wake: threading.Event | None,
        inline: bool = False,
    ) -> Any:
        """One Search call to one replica -> its future; its outcome feeds the replica's health
        and the shard's latencies, then sets ``wake``. ``inline``: the call runs in this thread
        and the future returned is done (no thread hand-off: a lone shard, never hedged)."""
        start = time.monotonic()
        if inline:
            fut: Future[Any] = Future()
            try:
                fut.set_result(self._stubs[address].Search(request, timeout=timeout))
            except Exception as e:  # grpc.RpcError, as a pooled call's future would hold it
                fut.set_exception(e)
        else:
            fut = self._pool.submit(self._stubs[address].Search, request, timeout=timeout)
        # a deadline miss says something about the replica only if it had time to answer
        judged = timeout >= self.config.shard_deadline_ms / 2000.0

        def done(f: Any) -> None:
            try:
                self._outcome(shard, address, f, time.monotonic() - start, judged)
            finally:
                if wake is not None:
                    wake.set()

        fut.add_done_callback(done)
        return fut

    def _outcome(self, shard: int, address: str, f: Any, latency: float, judged: bool) -> None:
        err = f.exception() if not f.cancelled() else None
        code = "CANCELLED" if f.cancelled() else ""
        if err is not None:
            code = err.code().name if hasattr(err, "code") else "UNKNOWN"
        now = time.monotonic()
        with self._lock:
            if not code:
                self._latency[shard].add(latency)
                change = self._health.succeeded(shard, address)
            elif code in FAILURE_CODES and (judged or code != "DEADLINE_EXCEEDED"):
                change = self._health.failed(shard, address, now)
            else:
                self._health.abandoned(shard, address)
                change = None
            in_rotation = self._health.in_rotation(shard)
        m, label = self.metrics, str(shard)
        if not code:
            m.answered(shard, address)
        if change is None:
            return
        m.in_rotation.labels(m.model, label).set(in_rotation)
        if change is Change.EJECTED:
            m.ejections.labels(m.model, label, address).inc()
            log.warning(
                "shard %d replica %s is out of rotation after %d failed calls in a row "
                "(last: %s); %d of %d replicas left",
                shard, address, self.config.eject_after_failures, code, in_rotation,
                len(self.shards[shard]),
            )  # fmt: skip
        else:
            log.info("shard %d replica %s answers again: back in rotation", shard, address)

    def search(
        self, request: pb.SearchRequest, timeout: float, skip: set[int]
    ) -> tuple[dict[int, pb.SearchResponse], dict[int, str]]:
        """Sends ``request`` to every shard but ``skip`` -> (answers, errors) by shard.

        Returns within ``timeout`` seconds (plus scheduling): a shard still silent then is an
        error (DEADLINE_EXCEEDED). Calls still running are not cancelled: they end by the same
        deadline and report their replica's health.
        """
        start = time.monotonic()
        deadline = start + timeout
        wake = threading.Event()
        turn = next(self._turn)
        pending: dict[int, _ShardCall] = {}
        for s in range(len(self.shards)):
            if s in skip:
                continue
            with self._lock:
                order, probe = self._health.order(s, turn, start)
                hedge_at = start + self.hedge_after(s)
                pending[s] = _ShardCall(s, order, self._health.in_rotation(s), hedge_at)
            if probe is not None:  # a copy: the replicas in rotation answer this round
                self.metrics.probes.labels(self.metrics.model, str(s), probe).inc()
                self.call(s, probe, request, timeout, None)
        calls = list(pending.values())
        # This thread makes the last call itself (no hand-off to a pool thread and back) when
        # no earlier call can need it meanwhile: none hedges or fails over to a replica.
        if calls and math.isinf(calls[-1].hedge_at):
            calls[-1].inline = all(len(c.order) == 1 and math.isinf(c.hedge_at) for c in calls[:-1])
        for call in calls:
            call.launch(self, request, timeout, wake)
        answers: dict[int, pb.SearchResponse] = {}
        errors: dict[int, str] = {}
        while pending:
            wake.clear()  # before looking, so a completion after the look wakes the wait
            now = time.monotonic()
            for s, call in list(pending.items()):
                got = call.answer()
                if got is not None:
                    answers[s] = got
                    self.metrics.round_trip(s, now - start)
                elif call.all_failed() and not (
                    now < deadline and call.launch(self, request, deadline - now, wake)  # fail over
                ):
                    errors[s] = f"{call.last_code}: {call.last_error}"
                    self._count_error(s, call.last_code)
                else:
                    continue
                del pending[s]
            if not pending:
                break
            if now >= deadline:
                for s in pending:
                    errors[s] = f"DEADLINE_EXCEEDED: no answer within {timeout * 1000:.0f} ms"
                    self._count_error(s, "DEADLINE_EXCEEDED")
                break
            for s, call in pending.items():
                if now >= call.hedge_at:
                    call.hedge_at = math.inf
                    if call.launch(self, request, deadline - now, wake, twin=True):
                        self.metrics.hedges.labels(self.metrics.model, str(s)).inc()
            next_hedge = min(call.hedge_at for call in pending.values())
            wake.wait(max(min(deadline, next_hedge) - now, 0.0))
        self._note_health(answers, errors)
        return answers, errors

    def _count_error(self, shard: int, code: str) -> None:
        self.metrics.errors.labels(self.metrics.model, str(shard), code or "UNKNOWN").inc()

    def _note_health(self, answers: dict[int, Any], errors: dict[int, str]) -> None:
        """Logs a shard once when it starts failing and once when it recovers."""
        for s, err in errors.items():
            if s not in self._failing:
                self._failing.add(s)
                log.warning("shard %d is not answering: %s", s, err)
        for s in answers:
            if s in self._failing:
                self._failing.discard(s)
                log.info("shard %d answers again", s)
