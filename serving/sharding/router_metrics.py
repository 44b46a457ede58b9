"""The router's Prometheus metrics (``serving/sharding/router.py``), in the server's registry:
per-shard latency and errors, hedges, partial batches, and per-replica answers, ejections,
probes and the replicas in rotation."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metric_series import Series


class RouterMetrics:
    """Per-shard latency and errors, hedges, partial batches, and per-replica answers,
    ejections and the replicas in rotation, in the server's registry."""

    def __init__(self, model: str, registry: CollectorRegistry):
        self.model = model
        self.latency = Histogram(
            "recserve_shard_latency_seconds",
            "Search round trip to a shard, as the router sees it (answers only)",
            ["model", "shard"],
            registry=registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
        )
        self.errors = Counter(
            "recserve_shard_errors",
            "Shard calls that gave no answer, by gRPC status",
            ["model", "shard", "code"],
            registry=registry,
        )
        self.hedges = Counter(
            "recserve_shard_hedges",
            "Twin calls sent to a replica",
            ["model", "shard"],
            registry=registry,
        )
        self.partial = Counter(
            "recserve_partial_batches",
            "Batches answered without some shard",
            ["model"],
            registry=registry,
        )
        self.answers = Counter(
            "recserve_replica_answers",
            "Search calls a shard replica answered (twins and probes included)",
            ["model", "shard", "replica"],
            registry=registry,
        )
        self.ejections = Counter(
            "recserve_replica_ejections",
            "Times a shard replica was taken out of rotation after failures in a row",
            ["model", "shard", "replica"],
            registry=registry,
        )
        self.probes = Counter(
            "recserve_replica_probes",
            "Copies of a request sent to an ejected replica whose back-off is over",
            ["model", "shard", "replica"],
            registry=registry,
        )
        self.in_rotation = Gauge(
            "recserve_replicas_in_rotation",
            "Replicas of a shard in rotation (not ejected)",
            ["model", "shard"],
            registry=registry,
        )
        # every round records these two
        self._answers, self._latency = Series(self.answers), Series(self.latency)

    def answered(self, shard: int, replica: str) -> None:
        """One more answer from ``replica`` of ``shard``."""
        self._answers(self.model, str(shard), replica).inc()

    def round_trip(self, shard: int, seconds: float) -> None:
        """A round's wait for ``shard``'s answer."""
        self._latency(self.model, str(shard)).observe(seconds)
