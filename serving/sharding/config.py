"""``[router]``: a router in front of document shard servers (``serving/sharding/router.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from common.config import Config, ConfigError, PathValue, Port, WaitMs, WaitS
from common.devices import DEVICE_PATTERN

Address = Annotated[str, Field(min_length=1, pattern=r"\S")]
"""``host:port`` of a server (not blank)."""


class RouterConfig(Config):
    """A router in front of document shard servers (``serving/sharding/router.py``)."""

    flags: ClassVar[Mapping[str, str]] = {
        "shards": "--shards",
        "shard_deadline_ms": "--shard-deadline-ms",
        "hedge_after_ms": "--hedge-after-ms",
        "embedding_servers": "--embedding-servers",
        "batches_in_flight": "--batches-in-flight",
    }

    shards: list[Annotated[list[Address], Field(min_length=1)]] = Field(default_factory=list)
    """Per shard (in shard order): the addresses of its replicas."""
    shard_deadline_ms: Annotated[WaitMs, Field(gt=0)] = 300.0
    """Longest a batch waits for a shard; a shard that misses it makes the answer partial. The
    default is above one TCP retransmission timeout (Linux's ``TCP_RTO_MIN``: what one lost
    segment of a shard's answer costs when no fast retransmit saves it) plus a busy host's
    answer, so a single loss on the router-shard link is no partial answer (a deadline equal to
    that timeout made every such loss one: ``bench/RELIABILITY.md``). It also leaves room for a
    busy host (a cold or CPU-starved shard on shared cores answers many times slower than a warm
    one); a fleet with spare cores on a lossless network sets it lower."""
    hedge_after_ms: WaitMs = 0.0
    """> 0: a shard replica that has not answered after this long gets a twin call to the next
    replica, and the first answer wins. 0: the delay follows ``hedge`` (a replica that fails
    fast always fails over to the next one)."""
    hedge: Literal["adaptive", "off"] = "adaptive"
    """With ``hedge_after_ms`` 0: ``adaptive`` hedges a shard of 2 or more replicas after the
    p95 of that shard's recent answers, bounded to [``hedge_min_ms``, ``hedge_max_ms``]
    (``hedge_max_ms`` until 20 answers came); ``off``: no twin calls."""
    hedge_min_ms: WaitMs = 5.0
    """Adaptive hedging: the shortest hedge delay (twin calls stay rare on a fast shard)."""
    hedge_max_ms: WaitMs = 100.0
    """Adaptive hedging: the longest hedge delay (a twin still has time before the deadline)."""
    eject_after_failures: int = Field(default=2, ge=0)
    """A replica that fails this many calls in a row (no answer in time, unreachable, internal
    error) leaves the rotation for a back-off, then gets one probe (a copy of a request another
    replica also answers) and returns when it answers; 0: never eject. A deadline miss counts
    only for a call that had at least half of ``shard_deadline_ms`` (a client's short deadline
    says nothing about the replica)."""
    eject_base_ms: Annotated[WaitMs, Field(gt=0)] = 500.0
    """First back-off of an ejected replica; it doubles with each failed probe."""
    eject_max_ms: Annotated[WaitMs, Field(gt=0)] = 10_000.0
    """Longest back-off of an ejected replica (it is probed at least this often)."""
    update_prepare_ms: Annotated[WaitMs, Field(gt=0)] = 10_000.0
    """Longest a live update (``--state-dir``) waits for the shards to prepare it, catching up
    replicas behind the log included; a shard none of whose replicas prepared it by then refuses
    the update (UNAVAILABLE, nothing changed anywhere). Cut to most of the caller's own deadline,
    so the caller gets that answer rather than its deadline. A prepare copies the shard's part
    (O(items x dim)): a catalog of tens of millions of items per shard may need more."""
    embedding_servers: list[Address] = Field(default_factory=list)
    """Addresses of embedding servers 0, 1, ... for the version's remote tables."""
    embedding_timeout_ms: Annotated[WaitMs, Field(gt=0)] = 500.0
    """Deadline of one remote-row fetch (a batch needing rows of a server that does not answer
    fails after it; a batch queued behind that one waits for it first)."""
    embedding_hold_bytes: int = Field(default=1 << 20, ge=0, le=1 << 34)
    """A range-partitioned remote table of at most this many bytes (rows x packed row bytes)
    is held whole by the router: fetched when the version loads, then read from memory, so
    its lookups keep answering while its embedding servers are down
    (``sharded_tables/remote/held.py``). Larger and hashed tables are fetched per batch and fail
    fast when their server does not answer. 0: hold none."""
    batches_in_flight: int = Field(default=2, ge=1)
    """Batches routed at once: while one waits on the shards the next runs its tower. Each
    batch is one call to every shard, whose cost is mostly per call, so more in flight means
    smaller batches and more calls per request: 2 keeps a router on a host of its own busy;
    where the shards share the router's cores (``recserve cluster up``) 1 is fastest (measured
    in ``bench/RESULTS.md``)."""

    def validate(self) -> None:  # type: ignore[override]  # see Config.validate
        """What the fields cannot say alone: a router needs shards, lower bounds are not above
        upper ones (``ConfigError``)."""
        if not self.shards:
            raise ConfigError(
                "router.shards (--shards): at least one shard (a list of replica addresses)"
            )
        if self.hedge_min_ms > self.hedge_max_ms:
            raise ConfigError(
                f"router.hedge_min_ms: must be <= hedge_max_ms ({self.hedge_max_ms:g}), "
                f"got {self.hedge_min_ms:g}"
            )
        if self.eject_base_ms > self.eject_max_ms:
            raise ConfigError(
                f"router.eject_base_ms: must be <= eject_max_ms ({self.eject_max_ms:g}), "
                f"got {self.eject_base_ms:g}"
            )


def parse_shards(text: str) -> list[list[str]]:
    """``--shards`` text: shards separated by ``,``, replicas of one shard by ``|``
    (``"h:1|h:2,h:3"`` -> ``[["h:1", "h:2"], ["h:3"]]``)."""
    return [[a.strip() for a in s.split("|") if a.strip()] for s in text.split(",") if s.strip()]


class ShardServerConfig(Config):
    """One ``recserve serve shard`` process: a document shard of a model's index over gRPC
    (``serving/sharding/shard_server.py``)."""

    flags: ClassVar[Mapping[str, str]] = {
        "model_repo": "--model-repo",
        "shard": "--shard",
        "model": "--model",
        "host": "--host",
        "grpc_port": "--grpc-port",
        "metrics_port": "--metrics-port",
        "poll_s": "--poll-s",
        "keep": "--keep",
        "device": "--device",
        "torch_threads": "--torch-threads",
        "compact_at": "--compact-at",
    }

    model_repo: PathValue
    """Model repository holding a document-sharded version."""
    shard: int = Field(ge=0)
    """Which document shard of the catalog to serve (0, 1, ...)."""
    model: str = ""
    """Model to serve; empty: the repository's only model."""
    host: str = Field(default="127.0.0.1", min_length=1)
    """Address to bind (this machine only by default)."""
    grpc_port: Port = 8101
    """gRPC port: Search, health; 0: any free port."""
    metrics_port: Port | None = None
    """Prometheus ``/metrics`` port; None: off."""
    poll_s: WaitS = 1.0
    """Seconds between repository checks for a new version (0: never)."""
    keep: int = Field(default=2, ge=1)
    """Versions kept loaded (a rollout needs 2: the old one answers until the new is ready)."""
    device: str = Field(default="cpu", pattern=DEVICE_PATTERN)
    """Where the index lives: ``cpu``, ``cuda`` or ``cuda:N`` (on a GPU the list scan is the
    Triton kernel, ``retrieval/index/gpu_scan.py``). Checked at start."""
    torch_threads: int = Field(default=0, ge=0, le=2**31 - 1)
    """Intra-op threads (0: torch's default)."""
    compact_at: int = Field(default=10_000, ge=0)
    """Live updates: the shard's fresh segment size (fresh rows plus tombstones) from which it
    is folded into its main lists on a background thread (``serving/live/compactor.py``, as
    ``ServeConfig.compact_at`` on a single server). 0: never fold (until the next publish)."""
