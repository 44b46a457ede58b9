"""``recserve serve model`` / ``serve router`` configuration: one typed object, from TOML plus flags, validated at start.

Example ``serve.toml`` (every key optional; flags override the file)::

    model_repo = "model_repo"
    model = "demo"
    grpc_port = 8001
    http_port = 8000
    metrics_port = 8002
    poll_s = 1.0
    drain_timeout_s = 10.0
    state_dir = "state"   # live updates: enables the admin API, holds the update logs

    [router]              # serve a document-sharded version: route to its shard servers
    shards = [["10.0.0.1:8101", "10.0.0.2:8101"], ["10.0.0.3:8101"]]  # per shard: replicas
    shard_deadline_ms = 300.0
    hedge_after_ms = 0.0  # > 0: ask the next replica when the first is this slow
    batches_in_flight = 2  # batches routed at once (1 where the shards share these cores)
    embedding_servers = ["10.0.0.9:8201"]  # the version's remote tables, server 0, 1, ...

    [batching]            # unset keys come from the model's config.pbtxt dynamic_batching
    max_batch_size = 32
    max_queue_delay_ms = 2.0
    max_queue_size = 1024
    preferred_batch_sizes = [8, 16]

    [security]            # common/security.py; all off by default
    token_file = "/run/secrets/recserve-token"  # admin calls need the token; serving ones too
    auth_serving = true   # false: only admin calls need the token (health never does)
    tls_cert = "server.crt"   # with tls_key: gRPC and HTTP serve TLS only
    tls_key = "server.key"

    [limits]              # serving/limits.py: the most one request may ask
    max_filter_bytes = 16384
    max_filter_clauses = 64
    max_filter_set_values = 1024
    max_seen = 100000      # ids in one request's seen list (seen / raw_seen)
    max_http_body_bytes = 8388608
    http_body_timeout_s = 10.0
    http_head_timeout_s = 10.0
    max_http_connections = 1024

Every error names the field (``serve.toml: batching.max_batch_size: must be >= 1, got 0``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from pydantic import Field

from common.config import MAX_WAIT_S, Config, ConfigError, PathValue, Port, WaitMs, WaitS
from common.devices import DEVICE_PATTERN, check_device
from common.security import SecurityConfig
from serving.engine.batching import BatchPolicy
from serving.limits import LimitsConfig
from serving.sharding.config import RouterConfig

CONFIG_FILE = "config.pbtxt"
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_QUEUE_DELAY_MS = 0.0
"""A batch starts as soon as the model is free and takes everything waiting: load alone grows
the batches, and a lone request never waits for others to join it (``bench/serving.py``
measures the latency this saves)."""
DEFAULT_MAX_QUEUE_SIZE = 1024
MAX_C_INT = 2**31 - 1
"""gRPC channel options and ``torch.set_num_threads`` take a C int."""
MAX_PROCESSES = 256


class BatchingConfig(Config):
    """Dynamic batching; a key left unset comes from the model's ``config.pbtxt``
    (``max_batch_size``, ``dynamic_batching``), else from the defaults above."""

    max_batch_size: int | None = Field(default=None, ge=1)
    """Most requests in one forward."""
    max_queue_delay_ms: WaitMs | None = None
    """Longest the oldest queued request waits for the batch to grow."""
    max_queue_size: int | None = Field(default=None, ge=0)
    """Most queued requests; one more gets RESOURCE_EXHAUSTED (HTTP 503). 0: no limit."""
    preferred_batch_sizes: list[Annotated[int, Field(ge=1)]] | None = None
    """Batch sizes sent as soon as the queue can fill them."""

    def validate(self) -> None:  # type: ignore[override]  # see Config.validate
        """What the fields cannot say alone: preferred sizes fit ``max_batch_size``
        (:class:`ConfigError` naming the field)."""
        top = self.max_batch_size
        for p in self.preferred_batch_sizes or ():
            if top is not None and p > top:
                raise ConfigError(
                    f"batching.preferred_batch_sizes: {p} is not in [1, max_batch_size={top}]"
                )

    def policy(self, model_config: Any = None) -> BatchPolicy:
        """The policy, filling unset keys from a Triton ``ModelConfig`` (or None)."""
        mbs, delay_ms, size, preferred = (
            self.max_batch_size,
            self.max_queue_delay_ms,
            self.max_queue_size,
            self.preferred_batch_sizes,
        )
        if model_config is not None:
            db = (
                model_config.dynamic_batching if model_config.HasField("dynamic_batching") else None
            )
            if mbs is None and model_config.max_batch_size > 0:
                mbs = int(model_config.max_batch_size)
            if db is not None:
                if delay_ms is None:  # uint64 microseconds: up to ~584k years
                    delay_ms = db.max_queue_delay_microseconds / 1000.0
                    if delay_ms > MAX_WAIT_S * 1000:
                        raise ConfigError(
                            f"{CONFIG_FILE} dynamic batching: max_queue_delay_microseconds: "
                            f"must be <= {MAX_WAIT_S * 1e6:.0f} (one day), "
                            f"got {db.max_queue_delay_microseconds}"
                        )
                if size is None and db.HasField("default_queue_policy"):
                    size = int(db.default_queue_policy.max_queue_size)
                if preferred is None and len(db.preferred_batch_size):
                    preferred = [int(p) for p in db.preferred_batch_size]
        mbs = DEFAULT_MAX_BATCH_SIZE if mbs is None else mbs
        try:
            return BatchPolicy(
                max_batch_size=mbs,
                max_queue_delay_s=(DEFAULT_MAX_QUEUE_DELAY_MS if delay_ms is None else delay_ms)
                / 1000.0,
                max_queue_size=DEFAULT_MAX_QUEUE_SIZE if size is None else size,
                preferred_sizes=tuple(p for p in (preferred or ()) if p <= mbs),
            )
        except ValueError as e:  # only values read from config.pbtxt can get here
            raise ConfigError(f"{CONFIG_FILE} dynamic batching: {e}") from None


class ServeConfig(Config):
    """One ``recserve serve model`` (or ``serve router``) process."""

    flags: ClassVar[Mapping[str, str]] = {
        "model_repo": "--model-repo",
        "model": "--model",
        "host": "--host",
        "grpc_port": "--grpc-port",
        "http_port": "--http-port",
        "metrics_port": "--metrics-port",
        "poll_s": "--poll-s",
        "torch_threads": "--torch-threads",
        "processes": "--processes",
        "frontends": "--frontends",
        "state_dir": "--state-dir",
        "device": "--device",
    }

    model_repo: PathValue | None = None
    """Model repository root (``<model>/config.pbtxt`` + numbered versions). Required."""
    model: str = ""
    """Model to serve; empty: the repository's only model."""
    host: str = Field(default="127.0.0.1", min_length=1)
    """Address every listener binds (gRPC, HTTP, metrics). The default is this machine only:
    listening elsewhere is an explicit ``--host``, best with ``[security]`` on."""
    grpc_port: Port = 8001
    """gRPC (Recommend, KServe v2, health); 0: any free port."""
    http_port: Port | None = None
    """HTTP (KServe v2 over HTTP, health); None: off."""
    metrics_port: Port | None = None
    """Prometheus ``/metrics``; None: off."""
    poll_s: WaitS = 1.0
    """How often the repository is checked for a new version (0: never)."""
    drain_timeout_s: Annotated[WaitS, Field(gt=0)] = 10.0
    """On SIGTERM: most seconds to finish in-flight requests before exiting."""
    close_linger_s: WaitS = 0.5
    """After the drain, how long the ports stay open answering UNAVAILABLE before they close
    (a call that races the close itself would get CANCELLED, which clients do not retry).
    Counted inside ``drain_timeout_s``."""
    grpc_workers: int = Field(default=64, gt=0)
    """gRPC handler threads. Each blocks on one request while it is batched, so this caps the
    requests in flight, and with it the batch size; keep it above ``max_batch_size``."""
    max_receive_message_bytes: int = Field(default=4 << 20, gt=0, le=MAX_C_INT)
    """Largest gRPC request; a larger one is refused (RESOURCE_EXHAUSTED, by gRPC)."""
    torch_threads: int = Field(default=0, ge=0, le=MAX_C_INT)
    """Intra-op threads of the forward (0: torch's default; in a group of ``processes``, the
    cores divided among them)."""
    device: str = Field(default="cpu", pattern=DEVICE_PATTERN)
    """Where the model runs: ``cpu``, ``cuda`` or ``cuda:N`` (towers, local table tiers, and the
    index when this process holds it: a router's index search runs on its shards, each with its
    own ``--device``). Checked at start: a GPU torch cannot see is refused."""
    processes: int = Field(default=1, ge=1, le=MAX_PROCESSES)
    """Serving processes sharing the gRPC and HTTP ports (``serving/app/processes.py``), each with
    its own model copy, batcher and Python interpreter lock: more of them use more cores for
    the Python parts of serving (gRPC handlers, parsing, each batch's many small ops). 1: this
    process serves. Not with ``state_dir`` (an update log has one writer). ``frontends``
    serves with one model copy instead."""
    frontends: int | None = Field(default=None, ge=0, le=MAX_PROCESSES)
    """Set: one engine process (the model, its batcher, live updates, hot reload) and this many
    front-end processes sharing the gRPC and HTTP ports (parsing, limits, rendering), joined by
    ZeroMQ (``serving/app/split.py``): every core feeds one batcher and one version, and live
    updates work. 0: the cores left after the engine's (at least 1). Not with ``processes`` or
    a router."""
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    """``[batching]``: dynamic batching (unset keys from the model's ``config.pbtxt``)."""
    router: RouterConfig | None = None
    """Set: this process is the router of a document-sharded model."""
    state_dir: PathValue | None = None
    """Serving state folder: set, the admin gRPC API (live updates: ``serving/protos/admin.proto``) is
    on and its update logs live here (``<model>/<version>/updates.log``, replayed on load).
    None: the admin API refuses every call. On a router (``[router]``) the updates go through it
    to every shard in two phases and are logged here once (``serving/sharding/routed_updates.py``)."""
    compact_at: int = Field(default=10_000, ge=0)
    """Live updates: the fresh segment's size (fresh rows plus tombstones) from which it is
    folded into the main lists on a background thread (``serving/live/compactor.py``). The
    segment is searched exactly beside the lists, so each request's cost grows with it
    (``bench/freshness.py`` measures how much); a fold copies the main index once (O(N * D)).
    0: never fold (until the next publish)."""
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    """Bearer tokens and TLS (``[security]``, ``common/security.py``); off by default."""
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    """``[limits]``: request size limits (filters, HTTP bodies), checked before parsing
    (``serving/limits.py``)."""

    # ---- loading ------------------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], where: str = "serve config", prefix: str = ""
    ) -> Self:
        """Builds from TOML-like data (errors name the key: ``<where>: batching.x: ...``)."""
        security = data.get("security")
        if isinstance(security, Mapping) and "token" in security:
            # a config file gets committed and copied; a secret must not be
            raise ConfigError(f"{where}: security.token: use token_file or token_env")
        return super().from_dict(data, where, prefix)

    def with_overrides(self, **flags: Any) -> ServeConfig:
        """A copy with every flag that is not None applied (flags win over the file)."""
        return self.updated(**flags)

    # ---- checks -------------------------------------------------------------------------------
    def validate(self) -> None:  # type: ignore[override]  # see Config.validate
        """What the fields cannot say alone (the repository exists, one model, no live updates
        on a router or a group); :class:`ConfigError` naming the first bad field."""
        if self.model_repo is None:
            raise ConfigError("model_repo: required (--model-repo or model_repo in the config)")
        if not self.model_repo.is_dir():
            raise ConfigError(f"model_repo: {self.model_repo} is not a folder")
        if self.frontends is not None and (self.processes > 1 or self.router is not None):
            what = "processes" if self.processes > 1 else "router"
            raise ConfigError(
                f"frontends: not with {what}: front-end processes feed one engine of a model "
                "(serve model --frontends N), a group of whole servers is --processes N"
            )
        if self.processes > 1 and self.state_dir is not None:
            raise ConfigError(
                "processes: live updates (state_dir) need one serving process: each process "
                "would apply an update to its own copy, and an update log has one writer"
            )
        self.batching.validate()
        try:
            check_device(self.device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.router is not None:
            self.router.validate()
        self.security.validate()
        if self.state_dir is not None and self.state_dir.exists() and not self.state_dir.is_dir():
            raise ConfigError(f"state_dir: {self.state_dir} exists and is not a folder")
        self.model = self.resolve_model()

    def resolve_model(self) -> str:
        """``model``, or the repository's only model; errors name ``model``."""
        assert self.model_repo is not None
        found = sorted(p.parent.name for p in self.model_repo.glob(f"*/{CONFIG_FILE}"))
        if self.model:
            if self.model not in found:
                raise ConfigError(
                    f"model: no model {self.model!r} in {self.model_repo} "
                    f"(found: {', '.join(found) or 'none'})"
                )
            return self.model
        if len(found) != 1:
            raise ConfigError(
                f"model: {self.model_repo} holds {len(found)} models "
                f"({', '.join(found) or 'none'}); name one with --model"
            )
        return found[0]
