"""Process wiring of ``recserve serve model`` (and ``serve router``): model host + batcher + gRPC/HTTP/metrics listeners.

:class:`Server` runs in-process too (tests, notebooks)::

    server = Server(ServeConfig(model_repo=Path("model_repo"), grpc_port=0))
    addresses = server.start()   # loads + warms the model, binds, health SERVING
    ...
    server.drain_and_stop()      # NOT_SERVING -> finish queued and in-flight -> close

:func:`serve` adds what a process needs: the ready line once ready (``common/ready.py``: JSON
with ``grpc``, ``http``, ``metrics``, ports 0 replaced by the bound ones) and SIGTERM/SIGINT ->
drain -> exit within ``drain_timeout_s``.

The front ends are registered in ``serving/app/frontends.py``: the KServe v2 HTTP app
(``make_app(state) -> ASGI app``, run by uvicorn on ``http_port``) and the gRPC services
(``add_servicer(server, state)``, on the same gRPC port); a caller may pass others.

With ``state_dir`` set, live updates are on (``serving/live/admin.py``): the host replays each
version's update log as it loads it, and the admin service applies new updates.

``[security]`` (``common/security.py``) is loaded once here: the token check and TLS go to the
gRPC and HTTP listeners, and a router calls its shards and embedding servers with the token
(and TLS with ``upstream_ca``). The metrics listener stays plaintext and open. Every listener
binds ``host``, 127.0.0.1 unless ``--host`` says otherwise. An inference call the token check
refuses (:func:`is_inference`: Recommend, KServe ``ModelInfer``, HTTP ``.../infer``; not health
or metadata) never reaches a front end, so the check's hook counts it: one failure, reason
``unauthenticated`` (Triton's ``OTHER``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from serving.app.config import ServeConfig
from serving.app.engine_parts import EngineParts
from serving.app.frontends import GRPC_SERVICES, HTTP_APP, HttpApp
from serving.engine.client import EngineClient
from serving.engine.host import ModelHost, Repository
from serving.engine.metrics import ServingMetrics
from serving.engine.state import ServingState
from serving.frontends.recommend_grpc import ExtraServicer, GrpcServer

if TYPE_CHECKING:
    from serving.live.updates import LiveUpdates
from common.grpc_util import bind_tcp, format_address
from common.ready import ReadyLine
from serving.app.announce import Addresses, announce_line, serving_ready

log = logging.getLogger(__name__)

INFERENCE_GRPC = frozenset(
    {
        "/recserve.serving.v1.Recommender/Recommend",
        "/inference.GRPCInferenceService/ModelInfer",
    }
)
INFERENCE_HTTP = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/infer")


def is_inference(method_or_path: str) -> bool:
    """A gRPC method or HTTP path that asks for recommendations (counted as a request when the
    token check refuses it); health, metadata and admin calls are not."""
    return method_or_path in INFERENCE_GRPC or bool(INFERENCE_HTTP.fullmatch(method_or_path))


class Server:
    """One serving process's parts; :meth:`start` and :meth:`drain_and_stop`."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        repo: Repository | None = None,
        extra_servicers: Sequence[ExtraServicer] | None = None,
        http_app: HttpApp | None = None,
        registry: CollectorRegistry | None = None,
        reuse_port: bool = False,
        engine: EngineClient | None = None,
    ):
        """``extra_servicers`` / ``http_app``: the gRPC services and the HTTP app to run
        (None: those of ``serving/app/frontends.py``). ``reuse_port``: bind the gRPC and HTTP
        ports with ``SO_REUSEPORT``, beside the other processes of a group
        (``serving/app/processes.py``); otherwise a taken port fails. ``engine``: the engine
        as a client, when it runs in another process (a front end of ``serving/app/split.py``);
        None: this process builds and runs it."""
        config.validate()  # fail fast, naming the field
        self.config, self.reuse_port = config, reuse_port
        self.security = config.security.load()  # reads the token and certificates once
        self._make_app: HttpApp | None = None
        if config.http_port is not None:
            self._make_app = HTTP_APP if http_app is None else http_app
        self.extra_servicers = list(GRPC_SERVICES if extra_servicers is None else extra_servicers)
        self.metrics = ServingMetrics(config.model, registry)
        self.remote = engine
        self.parts: EngineParts | None = None
        if engine is None:
            if repo is None:
                from serving.repository.repository import ModelRepository

                assert config.model_repo is not None
                repo = ModelRepository(config.model_repo, device=config.device)
            self.parts = EngineParts(config, repo, self.metrics, self.security.upstream)
        self.state: ServingState | None = None
        self.grpc: GrpcServer | None = None
        self.addresses: Addresses | None = None
        self._uvicorn: Any = None
        self._http_thread: threading.Thread | None = None

    @property
    def host(self) -> ModelHost:
        """The model host (this process runs the engine)."""
        assert self.parts is not None, "the engine runs in another process"
        return self.parts.host

    @property
    def updates(self) -> LiveUpdates | None:
        return None if self.parts is None else self.parts.updates

    @property
    def engine(self) -> EngineClient:
        assert self.state is not None, "start() first"
        return self.state.engine

    def start(self) -> Addresses:
        """Loads and warms the model (or finds the engine process serving), then binds every
        listener; raises ``OSError`` naming the port that cannot be bound."""
        cfg = self.config
        engine: EngineClient
        if self.parts is not None:
            engine = self.parts.start()
        else:
            assert self.remote is not None
            engine = self.remote
        self.state = ServingState(
            engine,
            self.metrics,
            routed=cfg.router is not None,
            updates=self.updates,
            limits=cfg.limits,
            remote_updates=self.parts is None and cfg.state_dir is not None,
        )
        self.grpc = GrpcServer(
            self.state,
            cfg.host,
            cfg.grpc_port,
            workers=cfg.grpc_workers,
            max_receive_message_bytes=cfg.max_receive_message_bytes,
            extra_servicers=self.extra_servicers,
            security=self.security,
            on_refused=self._count_refusal,
            reuse_port=self.reuse_port,
        )
        self.security.warn_if_exposed(cfg.host, "serve")
        grpc_address = self.grpc.start()
        metrics_address = http_address = None
        if cfg.metrics_port is not None:
            try:
                port = self.metrics.serve_http(cfg.metrics_port, cfg.host)
            except OSError as e:
                raise OSError(
                    f"metrics_port: cannot bind {cfg.host}:{cfg.metrics_port}: {e}"
                ) from None
            metrics_address = format_address(cfg.host, port)
        if self._make_app is not None:
            assert cfg.http_port is not None
            http_address = self._start_http(self._make_app(self.state), cfg.host, cfg.http_port)
        self.addresses = Addresses(grpc_address, http_address, metrics_address)
        return self.addresses

    def set_serving(self, ready: bool) -> None:
        """Health follows the engine's readiness (an engine process that died and came back)."""
        if self.grpc is not None and self.state is not None and not self.state.draining.is_set():
            self.grpc.set_serving(ready)

    def _start_http(self, app: Any, host: str, port: int) -> str:
        import uvicorn

        from serving.frontends.http_conn import http_options

        # without TCP_NODELAY (bind_tcp's IPPROTO_TCP lets asyncio set it) each answer on a
        # kept-alive connection waits for the peer's delayed ACK
        sock = bind_tcp(host, port, "http_port", reuse_addr=True, reuse_port=self.reuse_port)
        bound = sock.getsockname()[1]
        config = uvicorn.Config(
            self.security.wrap_http(app, self._count_refusal),
            log_level="warning", lifespan="off", **self.security.http_ssl,
            **http_options(self.config.limits),  # a head timeout, a cap on connections
        )  # fmt: skip
        server = uvicorn.Server(config)
        self._uvicorn = server
        self._http_thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True
        )
        self._http_thread.start()
        until = time.monotonic() + 30
        while not server.started:
            if not self._http_thread.is_alive() or time.monotonic() > until:
                raise OSError(f"http_port: uvicorn did not start on {host}:{bound}")
            time.sleep(0.01)
        return format_address(host, bound)

    def _count_refusal(self, method_or_path: str, reason: str) -> None:
        """The token check refused a call: an inference one is one failed request."""
        if is_inference(method_or_path):
            version = None if self.state is None else self.state.engine.version
            self.metrics.request_done(version, 0.0, reason)

    def announce_line(self) -> str:
        """The sentence for people (the log); :meth:`ready` is the line for programs."""
        assert self.addresses is not None
        info = self.engine.info()
        return announce_line(info.name, info.version, self.addresses, self.security.describe())

    def ready(self) -> ReadyLine:
        """The ready line (``common/ready.py``), once :meth:`start` returned."""
        assert self.addresses is not None
        info = self.engine.info()
        return serving_ready(
            self.config.router is not None,
            info.name,
            info.version,
            self.addresses,
            self.security.describe(),
        )

    def drain_and_stop(self, timeout: float | None = None) -> bool:
        """Not ready -> finish queued and in-flight requests -> close, within ``timeout`` s
        (default ``drain_timeout_s``). Returns False when the drain did not finish in time."""
        until = time.monotonic() + (self.config.drain_timeout_s if timeout is None else timeout)

        def left() -> float:
            return max(until - time.monotonic(), 0.0)

        clean = True
        if self.state is not None:
            self.state.draining.set()  # new requests: UNAVAILABLE
        if self.grpc is not None:
            self.grpc.drain()  # health: NOT_SERVING
        # a front end's calls in flight finish on the engine process: it waits for their answers
        clean = self.parts.drain(left()) if self.parts is not None else self._wait_calls(left)
        time.sleep(min(self.config.close_linger_s, left()))  # late callers hear UNAVAILABLE
        if self.grpc is not None:
            self.grpc.stop(grace=left())
        if self._uvicorn is not None and self._http_thread is not None:
            self._uvicorn.should_exit = True
            self._http_thread.join(left())
        self.metrics.stop_http()
        if self.parts is not None:
            self.parts.close(left())
        elif self.remote is not None:
            self.remote.close()
        return clean

    def _wait_calls(self, left: Callable[[], float]) -> bool:
        """A front end's drain: until the calls it sent the engine are answered (or time)."""
        pending = getattr(self.remote, "pending", None)  # the ZeroMQ client counts them
        while pending is not None and pending() and left() > 0:
            time.sleep(0.01)
        return pending is None or not pending()
