"""``recserve serve`` configuration: one typed object, from TOML plus flags, validated at start.

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
    shard_deadline_ms = 100.0
    hedge_after_ms = 0.0  # > 0: ask the next replica when the first is this slow
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

Every error names the field (``serve config: batching.max_batch_size: must be >= 1, got 0``).
"""

from __future__ import annotations

import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from common.config import MAX_WAIT_S, ConfigError, check_wait
from common.security import SecurityConfig
from serving.engine.batching import BatchPolicy
from serving.sharding.config import RouterConfig

CONFIG_FILE = "config.pbtxt"
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_QUEUE_DELAY_MS = 0.0
"""A batch starts as soon as the model is free and takes everything waiting: load alone grows
the batches, and a lone request never waits (bench/serving.py: p50 at one client 5.3 -> 2.2 ms)."""
DEFAULT_MAX_QUEUE_SIZE = 1024
MAX_C_INT = 2**31 - 1
"""gRPC channel options and ``torch.set_num_threads`` take a C int."""
MAX_PROCESSES = 256


@dataclass
class BatchingConfig:
    """Dynamic batching; a key left unset comes from the model's ``config.pbtxt``
    (``max_batch_size``, ``dynamic_batching``), else from the defaults above."""

    max_batch_size: int | None = None
    """Most requests in one forward."""
    max_queue_delay_ms: float | None = None
    """Longest the oldest queued request waits for the batch to grow."""
    max_queue_size: int | None = None
    """Most queued requests; one more gets RESOURCE_EXHAUSTED (HTTP 503). 0: no limit."""
    preferred_batch_sizes: list[int] | None = None
    """Batch sizes sent as soon as the queue can fill them."""

    def validate(self) -> None:
        """Checks the keys that are set (raises :class:`ConfigError` naming the field)."""
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ConfigError(f"batching.max_batch_size: must be >= 1, got {self.max_batch_size}")
        if self.max_queue_delay_ms is not None:
            check_wait("batching.max_queue_delay_ms", self.max_queue_delay_ms / 1000.0, ms=True)
            if not self.max_queue_delay_ms >= 0:
                raise ConfigError(
                    f"batching.max_queue_delay_ms: must be >= 0, got {self.max_queue_delay_ms}"
                )
        if self.max_queue_size is not None and self.max_queue_size < 0:
            raise ConfigError(
                f"batching.max_queue_size: must be >= 0 (0: no limit), got {self.max_queue_size}"
            )
        top = self.max_batch_size
        for p in self.preferred_batch_sizes or ():
            if p < 1 or (top is not None and p > top):
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


@dataclass
class ServeConfig:
    """One ``recserve serve`` process."""

    model_repo: Path | None = None
    """Model repository root (``<model>/config.pbtxt`` + numbered versions). Required."""
    model: str = ""
    """Model to serve; empty: the repository's only model."""
    host: str = "127.0.0.1"
    """Address every listener binds (gRPC, HTTP, metrics). The default is this machine only:
    listening elsewhere is an explicit ``--host``, best with ``[security]`` on."""
    grpc_port: int = 8001
    """gRPC (Recommend, KServe v2, health); 0: any free port."""
    http_port: int | None = None
    """HTTP (KServe v2 over HTTP, health); None: off."""
    metrics_port: int | None = None
    """Prometheus ``/metrics``; None: off."""
    poll_s: float = 1.0
    """How often the repository is checked for a new version (0: never)."""
    drain_timeout_s: float = 10.0
    """On SIGTERM: most seconds to finish in-flight requests before exiting."""
    close_linger_s: float = 0.5
    """After the drain, how long the ports stay open answering UNAVAILABLE before they close
    (a call that races the close itself would get CANCELLED, which clients do not retry).
    Counted inside ``drain_timeout_s``."""
    grpc_workers: int = 64
    """gRPC handler threads. Each blocks on one request while it is batched, so this caps the
    requests in flight, and with it the batch size; keep it above ``max_batch_size``."""
    max_receive_message_bytes: int = 4 << 20
    """Largest gRPC request; a larger one is refused (RESOURCE_EXHAUSTED, by gRPC)."""
    torch_threads: int = 0
    """Intra-op threads of the forward (0: torch's default; in a group of ``processes``, the
    cores divided among them)."""
    processes: int = 1
    """Serving processes sharing the gRPC and HTTP ports (``serving/app/processes.py``), each with
    its own model copy, batcher and Python interpreter lock: more of them use more cores for
    the Python parts of serving (gRPC handlers, parsing, each batch's many small ops). 1: this
    process serves. Not with ``state_dir`` (an update log has one writer)."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    router: RouterConfig | None = None
    """Set: this process is the router of a document-sharded model."""
    state_dir: Path | None = None
    """Serving state folder: set, the admin gRPC API (live updates: ``serving/protos/admin.proto``) is
    on and its update logs live here (``<model>/<version>/updates.log``, replayed on load).
    None: the admin API refuses every call. Not with ``[router]``."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """Bearer tokens and TLS (``[security]``, ``common/security.py``); off by default."""

    # ---- loading ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "serve config") -> ServeConfig:
        """Builds from TOML-like data, checking every key's type (errors name the key)."""
        data = dict(data)
        batching = data.pop("batching", {})
        router = data.pop("router", None)
        security = data.pop("security", {})
        tables = (("batching", batching), ("router", router or {}), ("security", security))
        for key, table in tables:
            if not isinstance(table, dict):
                raise ConfigError(f"{where}: {key}: expected a table, got {table!r}")
        out = cls(**_typed(cls, data, where, ""))
        out.batching = BatchingConfig(**_typed(BatchingConfig, batching, where, "batching."))
        if router is not None:
            out.router = RouterConfig(**_typed(RouterConfig, router, where, "router."))
        if "token" in security:  # a config file gets committed and copied; a secret must not be
            raise ConfigError(f"{where}: security.token: use token_file or token_env")
        out.security = SecurityConfig(**_typed(SecurityConfig, security, where, "security."))
        return out

    @classmethod
    def from_toml(cls, path: Path) -> ServeConfig:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))  # TOML is UTF-8
        except OSError as e:
            raise ConfigError(f"--config: cannot read {path}: {e}") from None
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None
        except RecursionError:  # tomllib recurses once per level of nested arrays and tables
            raise ConfigError(f"--config: {path} is not valid TOML: nested too deep") from None
        return cls.from_dict(data, where=str(path))

    def with_overrides(self, **flags: Any) -> ServeConfig:
        """A copy with every flag that is not None applied (flags win over the file)."""
        given = {k: v for k, v in flags.items() if v is not None}
        for key in ("model_repo", "state_dir"):
            if key in given:
                given[key] = Path(given[key])
        return replace(self, **given)

    # ---- checks -------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raises :class:`ConfigError` naming the first bad field."""
        if self.model_repo is None:
            raise ConfigError("model_repo: required (--model-repo or model_repo in the config)")
        if not self.model_repo.is_dir():
            raise ConfigError(f"model_repo: {self.model_repo} is not a folder")
        if not self.host:
            raise ConfigError("host: must not be empty")
        for name in ("grpc_port", "http_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{name}: must be in [0, 65535], got {port}")
        for name in ("poll_s", "drain_timeout_s", "close_linger_s"):
            check_wait(name, getattr(self, name))
        positive = ("drain_timeout_s", "grpc_workers", "max_receive_message_bytes")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("max_receive_message_bytes", "torch_threads"):
            if getattr(self, name) > MAX_C_INT:
                raise ConfigError(f"{name}: must be <= {MAX_C_INT}, got {getattr(self, name)}")
        for name in ("poll_s", "torch_threads", "close_linger_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.processes <= MAX_PROCESSES:
            raise ConfigError(f"processes: must be in [1, {MAX_PROCESSES}], got {self.processes}")
        if self.processes > 1 and self.state_dir is not None:
            raise ConfigError(
                "processes: live updates (state_dir) need one serving process: each process "
                "would apply an update to its own copy, and an update log has one writer"
            )
        self.batching.validate()
        if self.router is not None:
            self.router.validate()
        self.security.validate()
        if self.state_dir is not None:
            if self.router is not None:
                raise ConfigError(
                    "state_dir: live updates are not supported on a router ([router] is set): "
                    "a document-sharded version is updated by publishing a new one"
                )
            if self.state_dir.exists() and not self.state_dir.is_dir():
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


def _typed(cls: type, data: dict[str, Any], where: str, prefix: str) -> dict[str, Any]:
    """Checks ``data`` against ``cls``'s field types; returns the values to construct it."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)} - {"batching", "router", "security"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: {prefix}{unknown[0]}: unknown key (known: {sorted(known)})")
    out = {}
    for key, value in data.items():
        expected = _allowed(hints[key])
        if not _matches(value, expected):
            names = " or ".join(getattr(t, "__name__", str(t)) for t in expected)
            raise ConfigError(f"{where}: {prefix}{key}: expected {names}, got {value!r}")
        if Path in expected and isinstance(value, str):
            value = Path(value)
        elif float in expected and isinstance(value, int):
            value = float(value)
        out[key] = value
    return out


def _allowed(hint: Any) -> tuple[Any, ...]:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return tuple(a for a in args if a is not type(None))


def _matches(value: Any, expected: tuple[Any, ...]) -> bool:
    for t in expected:
        if typing.get_origin(t) is list:
            (item,) = typing.get_args(t)
            if isinstance(value, list) and all(_matches(v, (item,)) for v in value):
                return True
        elif t is Path:
            if isinstance(value, str):
                return True
        elif t is float:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return True
        elif t is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif isinstance(value, t):
            return True
    return False
