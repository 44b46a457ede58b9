"""``[router]``: a router in front of document shard servers (``serving/sharding/router.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config import ConfigError, check_wait


@dataclass
class RouterConfig:
    """A router in front of document shard servers (``serving/sharding/router.py``)."""

    shards: list[list[str]] = field(default_factory=list)
    """Per shard (in shard order): the addresses of its replicas."""
    shard_deadline_ms: float = 100.0
    """Longest a batch waits for a shard; a shard that misses it makes the answer partial."""
    hedge_after_ms: float = 0.0
    """> 0: a shard replica that has not answered after this long gets a twin call to the next
    replica, and the first answer wins. 0: no hedging (a replica that fails fast still fails
    over to the next one)."""
    embedding_servers: list[str] = field(default_factory=list)
    """Addresses of embedding servers 0, 1, ... for the version's remote tables."""
    embedding_timeout_ms: float = 500.0
    """Deadline of one remote-row fetch."""
    batches_in_flight: int = 4
    """Batches routed at once: while one waits on the shards the next runs its tower."""

    def validate(self) -> None:
        """Raises :class:`ConfigError` naming the first bad field."""
        if not self.shards:
            raise ConfigError("router.shards: at least one shard (a list of replica addresses)")
        for i, replicas in enumerate(self.shards):
            if not replicas or not all(isinstance(a, str) and a.strip() for a in replicas):
                raise ConfigError(f"router.shards[{i}]: expected one or more host:port addresses")
        for name in ("shard_deadline_ms", "embedding_timeout_ms", "hedge_after_ms"):
            check_wait(f"router.{name}", getattr(self, name) / 1000.0, ms=True)
        for name in ("shard_deadline_ms", "embedding_timeout_ms"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"router.{name}: must be > 0, got {getattr(self, name)}")
        if self.batches_in_flight < 1:
            raise ConfigError(
                f"router.batches_in_flight: must be >= 1, got {self.batches_in_flight}"
            )
        if not self.hedge_after_ms >= 0:
            raise ConfigError(f"router.hedge_after_ms: must be >= 0, got {self.hedge_after_ms}")


def parse_shards(text: str) -> list[list[str]]:
    """``--shards`` text: shards separated by ``,``, replicas of one shard by ``|``
    (``"h:1|h:2,h:3"`` -> ``[["h:1", "h:2"], ["h:3"]]``)."""
    return [[a.strip() for a in s.split("|") if a.strip()] for s in text.split(",") if s.strip()]
