"""A document shard server: one shard's part of a model's index, searched over gRPC.

``recserve serve shard --model-repo DIR --model NAME --shard S`` loads shard ``S`` of the newest
document-sharded version of ``NAME``, answers ``Shard.Search`` (``serving/protos/shard.proto``) and
grpc.health.v1 (SERVING once loaded), and watches the repository (the model host's
``VersionWatcher``, ``serving/repository/watcher.py``): a newer version is loaded beside the one
serving, and the newest ``keep`` versions stay loaded, so a router still on the
previous version keeps getting answers during a rollout (it moves once every shard holds the
new one; see ``serving/sharding/router.py``)::

    server = ShardServer(ModelRepository("model_repo"), "demo", shard=0)
    address = server.start()      # "127.0.0.1:PORT"
    ...
    server.stop()

With ``security`` (``common/security.py``) the searches need the router's bearer token and the
port serves TLS; health checks stay open.

The shard runs exactly the router's plan (``retrieval/index/search.py``): it never plans itself,
since planning needs the whole catalog's statistics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from common.grpc_util import add_service, bind_port, format_address
from common.metric_series import Series
from common.ready import ReadyLine, ready_line
from common.security import NO_SECURITY, Security
from common.stop_signals import serve_then_stop
from common.torch_threads import use_process_threads
from retrieval.index.ivf import IVFIndex
from serving.protos import shard_pb2 as pb
from serving.protos import shard_pb2_grpc as pb_grpc
from serving.repository.repository import ModelRepository
from serving.repository.watcher import VersionWatcher
from serving.sharding.shard_parts import PartRefusedError, ShardParts
from serving.sharding.wire import decode_request, encode_response, tensor_bytes
from serving.types import error_message

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE = "recserve.shard.v1.Shard"
MAX_MESSAGE_BYTES = 256 << 20
"""A K=10,000 answer for a batch of 32 is ~5 MB; vectors for a head multiply that by D."""
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def warm_up(index: IVFIndex, batch_sizes: tuple[int, ...] = (1, 8)) -> None:
    """Searches ``index`` as a router would (unfiltered; filtered and exact, with vectors) once
    per batch size, so the first routed search does not pay the first-call costs (the
    kernels' first dispatch, the pages of the codes) inside the router's shard
    deadline. Raises when the index cannot answer."""
    if index.ntotal == 0:
        return
    k = min(10, index.ntotal)
    attr, values = next(iter(index.schema.to_dict().items()), ("", []))
    some_filter = f"{attr} = {values[0]!r}" if values else None
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for size in batch_sizes:
            q = torch.randn(size, index.dim, generator=gen).to(index.centroids.device)
            for text, exact in ((None, False), (some_filter, True)):
                fb = index.compile_filter(text, size)
                plan = index.plan(fb, index.params(k, exact=exact))
                index.item_candidates(q, fb, plan, with_vectors=exact)


class ShardMetrics:
    """Per-shard Prometheus series (own registry: one per server, also in tests)."""

    def __init__(self, model: str, shard: int, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        labels = {"model": model, "shard": str(shard)}
        self.latency = Histogram(
            "recserve_shard_search_seconds",
            "Search time inside the shard",
            list(labels),
            registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
        ).labels(**labels)
        self._requests = Counter(
            "recserve_shard_search_requests",
            "Search calls by gRPC status",
            [*labels, "code"],
            registry=r,
        )
        self._labels = labels
        self._by_code = Series(self._requests)
        self.version = Gauge(
            "recserve_shard_version", "Newest version loaded", list(labels), registry=r
        ).labels(**labels)
        self._http: Any = None

    def request(self, code: str) -> None:
        self._by_code(*self._labels.values(), code).inc()

    def serve_http(self, port: int, host: str) -> int:
        self._http = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http[0].server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http[0].shutdown()
            self._http = None


class ShardServicer(pb_grpc.ShardServicer):
    def __init__(self, server: ShardServer):
        self.server = server

    def Search(self, request: pb.SearchRequest, context: grpc.ServicerContext) -> pb.SearchResponse:
        s = self.server
        start = time.monotonic()
        code = grpc.StatusCode.OK
        try:
            version, index = s.parts.search_index(request.model, request.version, request.sequence)
            q, fb, plan = self._decode(request, index)
            dev = index.centroids.device
            if dev.type != "cpu":  # decoded on the host
                q, fb = q.to(dev), fb.to(dev)
            with torch.inference_mode():
                cand = index.item_candidates(q, fb, plan, with_vectors=request.with_vectors)
            return encode_response(s.shard, version, cand)
        except PartRefusedError as e:
            code = grpc.StatusCode[e.code]
            context.abort(code, error_message(e))
            raise  # not reached: abort raises
        except Exception:
            code = grpc.StatusCode.INTERNAL
            raise
        finally:
            s.metrics.request(code.name)
            s.metrics.latency.observe(time.monotonic() - start)

    # ---- live updates through the router (serving/sharding/shard_parts.py) --------------------
    def Prepare(
        self, request: pb.PrepareRequest, context: grpc.ServicerContext
    ) -> pb.PrepareResponse:
        parts = self.server.parts
        if context.time_remaining() <= 0:  # a frozen or starved replica: the router gave up
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"update {request.sequence}: its deadline passed before the prepare started",
            )
        r = request
        done = self._updating(
            context, lambda: parts.prepare(r.model, r.version, r.sequence, r.record, r.attempt)
        )
        return pb.PrepareResponse(
            shard=parts.shard,
            held=tensor_bytes(done.held, np.uint8),
            list_sizes=tensor_bytes(done.list_sizes(), np.int64),
            bit_counts=tensor_bytes(done.bit_counts(), np.int64),
            served=done.served(),
        )

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        parts = self.server.parts
        r = request
        self._updating(context, lambda: parts.commit(r.model, r.version, r.sequence, r.attempt))
        return pb.CommitResponse()

    def Abort(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        self.server.parts.abort(request.version, request.sequence, request.attempt)
        return pb.CommitResponse()

    @staticmethod
    def _updating(context: grpc.ServicerContext, step: Callable[[], T]) -> T:
        try:
            return step()
        except PartRefusedError as e:
            context.abort(grpc.StatusCode[e.code], error_message(e))
            raise  # not reached: abort raises

    @staticmethod
    def _decode(request: pb.SearchRequest, index: IVFIndex) -> tuple[torch.Tensor, Any, Any]:
        try:
            q, fb, plan = decode_request(request)
        except ValueError as e:
            raise PartRefusedError("INVALID_ARGUMENT", str(e)) from None
        if q.shape[1] != index.dim or fb.masks.shape[2] != index.schema.num_words:
            raise PartRefusedError(
                "INVALID_ARGUMENT",
                f"dim, words: this shard's index has dim={index.dim}, "
                f"words={index.schema.num_words}; got {q.shape[1]}, {fb.masks.shape[2]}",
            )
        if plan.lists is not None and bool((plan.lists >= index.nlist).any()):
            raise PartRefusedError(
                "INVALID_ARGUMENT", f"lists: this shard's index has {index.nlist} lists"
            )
        return q, fb, plan

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        s = self.server
        held = s.parts.sequences()
        return pb.InfoResponse(
            model=s.model,
            shard=s.shard,
            num_shards=s.num_shards,
            versions=sorted(held),
            sequences=[held[v] for v in sorted(held)],
        )


class ShardServer:
    """Loads, serves and hot-swaps one document shard of a model."""

    def __init__(
        self,
        repo: ModelRepository,
        model: str,
        shard: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        poll_s: float = 1.0,
        keep: int = 2,
        workers: int = 8,
        device: str = "cpu",
        registry: CollectorRegistry | None = None,
        security: Security = NO_SECURITY,
        compact_at: int = 0,
    ):
        if shard < 0:
            raise ValueError(f"--shard: must be >= 0, got {shard}")
        if keep < 1:
            raise ValueError(f"keep: must be >= 1, got {keep}")
        self.repo, self.model, self.shard = repo, model, shard
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.poll_s, self.device = poll_s, device
        self.parts = ShardParts(model, shard, keep, compact_at)
        """Loaded versions -> this shard's part, with their live updates (a fresh segment of
        ``compact_at`` rows or more folded in the background; 0: never)."""
        self.watcher = VersionWatcher(
            lambda: repo.versions(model),
            self._load,
            self._refused,
            poll_s=poll_s,
            thread_name="shard-poll",
            what=f"shard {shard}",
        )
        """Loads each newer version beside the ones held; refused versions are never retried."""
        self.metrics = ShardMetrics(model, shard, registry)
        self.health = health.HealthServicer()
        self.security = security
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, initializer=use_process_threads),
            interceptors=security.interceptors(),
            options=GRPC_OPTIONS,
        )
        add_service(self._server, pb, SERVICE, ShardServicer(self))  # garbage: INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.metrics_address: str | None = None

    @property
    def held(self) -> list[int]:
        """Loaded versions, ascending."""
        return sorted(self.parts.versions)

    @property
    def failed(self) -> set[int]:
        """Versions whose shard failed to load; never retried."""
        return self.watcher.failed

    @property
    def num_shards(self) -> int:
        return self.parts.num_shards

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    # ---- versions -----------------------------------------------------------------------------
    def _load(self, version: int) -> None:
        """Loads and warms up this shard of ``version`` beside the held ones; raises when it
        is refused (corrupt, not sharded, no such shard, or it cannot search)."""
        index, smap = self.repo.load_shard(self.model, version, self.shard, self.device)
        warm_up(index)
        self.parts.add(version, index, smap.num_shards)  # the swap
        self.metrics.version.set(max(self.parts.versions))
        log.info("shard %d/%d: loaded %s v%d", self.shard, smap.num_shards, self.model, version)

    def _refused(self, version: int, error: Exception) -> None:
        log.error("shard %d: version %d of %s refused: %s", self.shard, version, self.model, error)

    def poll_once(self) -> int | None:
        """Loads the newest version above the newest held one; returns it, or None."""
        return self.watcher.poll_once()

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> str:
        """Loads and warms up the newest loadable version, binds, reports SERVING; returns
        ``host:port``."""
        if self.watcher.load_newest() is None:
            raise FileNotFoundError(
                f"model {self.model!r}: no version with a loadable shard {self.shard} in "
                f"{self.repo.root} (publish it with shards=...; see the log)"
            )
        self.security.warn_if_exposed(self.host, f"shard-server {self.shard}")
        creds = self.security.grpc_credentials
        self.port = bind_port(self._server, self.host, self.port, "--grpc-port", creds)
        self._server.start()
        if self.metrics_port is not None:
            try:
                port = self.metrics.serve_http(self.metrics_port, self.host)
            except OSError as e:
                raise OSError(f"--metrics-port: cannot bind {self.metrics_port}: {e}") from None
            self.metrics_address = format_address(self.host, port)
        for service in ("", SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.watcher.start()
        return self.address

    def ready(self) -> ReadyLine:
        """The ready line (``common/ready.py``): role ``shard``, its slot as extras."""
        return ready_line(
            "shard",
            grpc=self.address,
            metrics=self.metrics_address,
            model=self.model,
            version=max(self.held),
            security=self.security.describe(),
            shard=self.shard,
            num_shards=self.num_shards,
        )

    def announce_line(self) -> str:
        """The same facts as a sentence for people (the log)."""
        secured = self.security.describe()
        return (
            f"shard-server {self.model} v{max(self.held)} shard {self.shard}/{self.num_shards} "
            f"listening on {self.address} metrics={self.metrics_address or 'off'}"
            + (f" security={secured}" if secured else "")
        )

    def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING, in-flight searches finish (up to ``grace`` s), then close."""
        self.watcher.stop(0)
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self.metrics.stop_http()


def serve_shard(server: ShardServer, grace: float = 5.0) -> None:
    """Serves until SIGTERM or SIGINT (prints the ready line once ready), then stops."""

    def start() -> ReadyLine:
        server.start()
        log.info("%s", server.announce_line())
        return server.ready()

    serve_then_stop(start, server.stop, grace)
