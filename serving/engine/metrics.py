"""Prometheus metrics of one server, with Triton's names so Triton dashboards work unchanged.

Every :class:`ServingMetrics` owns its own ``CollectorRegistry`` (tests run several servers in
one process). Triton's cumulative counters keep their exact names — ``nv_inference_*``, no
``_total`` suffix, which ``prometheus_client`` would add to a ``Counter`` — so they are exported
as untyped samples by a small collector; recserve's own metrics use ``prometheus_client`` types:

===========================================  ==========================  ========================
metric                                       labels                      meaning
===========================================  ==========================  ========================
``nv_inference_request_success``             model, version              calls answered
``nv_inference_request_failure``             model, version, reason      calls refused/failed
``nv_inference_count``                       model, version              inferences (batch rows)
``nv_inference_exec_count``                  model, version              forwards (batches)
``nv_inference_request_duration_us``         model, version              arrival -> answer, summed
``nv_inference_queue_duration_us``           model, version              time queued, summed
``nv_inference_compute_infer_duration_us``   model, version              forward time, summed
``recserve_request_failures_total``          model, reason               calls refused/failed
``recserve_batch_size``                      model                       histogram of B
``recserve_request_duration_seconds``        model                       histogram (percentiles)
``recserve_model_version``                   model                       version being served
``recserve_model_reloads_total``             model, result (ok/failed)   hot-reload attempts
``recserve_queue_waiting``                   model                       requests queued now
``recserve_updates_applied_total``           model, kind                 live update batches applied
``recserve_update_failures_total``           model, kind, reason         live updates refused/failed
``recserve_updates_replayed_total``          model                       log records replayed on load
``recserve_update_sequence``                 model                       last update of the version
``recserve_index_list_imbalance``            model                       largest IVF list / mean
``recserve_index_rebuild_recommended``       model                       1: lists unbalanced, rebuild
===========================================  ==========================  ========================

Counted as Triton counts (``docs/user_guide/metrics.md`` of triton-inference-server/server): a
*request* is one client call — a ``Recommend``, or a KServe ``infer`` of B rows — counted once in
``nv_inference_request_success`` or ``nv_inference_request_failure`` however many rows it holds;
``nv_inference_count`` counts its rows (inferences) when they run, ``nv_inference_exec_count``
the forwards that ran them (so count / exec_count is the mean batch size). Every refusal is a
failure, the ones before the engine too (a body that is no JSON, a bad tensor, an unknown
model): the front ends open a :class:`~serving.engine.state.Call` when a call arrives and close
it once, with its result or its error.

``recserve_request_failures_total``'s ``reason`` is the error's ``serving.types.error_status``
reason (``invalid_argument``, ``not_found``, ``queue_full``, ``deadline_exceeded``,
``unavailable``, ``cancelled``, ``internal``; ``too_large`` for an HTTP body over the limit;
``unauthenticated`` for an inference call the token check refused, before any front end ran:
``serving/app/server.py`` hears it from ``common.security``'s ``on_refused`` hook);
``nv_inference_request_failure``'s is Triton's coarser one (:data:`TRITON_REASON`:
``REJECTED``, ``CANCELED``, ``BACKEND``, ``OTHER``), so each of Triton's reasons sums some of
ours and both counters hold the same total.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

_TRITON: dict[str, tuple[str, tuple[str, ...]]] = {
    "nv_inference_request_success": (
        "Number of successful inference requests, all batch sizes",
        (),
    ),
    "nv_inference_request_failure": (
        "Number of failed inference requests, all batch sizes",
        ("reason",),
    ),
    "nv_inference_count": ("Number of inferences performed (batch rows)", ()),
    "nv_inference_exec_count": ("Number of model executions performed (batches)", ()),
    "nv_inference_request_duration_us": ("Cumulative request duration in microseconds", ()),
    "nv_inference_queue_duration_us": ("Cumulative time requests spent queued, us", ()),
    "nv_inference_compute_infer_duration_us": ("Cumulative model execution time, us", ()),
}
TRITON_REASON = {
    "queue_full": "REJECTED",
    "deadline_exceeded": "REJECTED",
    "cancelled": "CANCELED",
    "internal": "BACKEND",
}
"""Our failure reason -> Triton's (``REJECTED``: the scheduler refused it, queue full or timed
out; ``CANCELED``; ``BACKEND``: the model failed); any other reason is ``OTHER``, as for
``unauthenticated``: like a bad argument, the caller's fault, not the scheduler's."""
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _TritonCounters(Collector):
    """Cumulative counters exported under their exact names (untyped samples)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {
            name: {} for name in _TRITON
        }

    def inc(self, name: str, amount: float, labels: dict[str, str]) -> None:
        self.add(tuple(sorted(labels.items())), ((name, amount),))

    def add(self, key: tuple[tuple[str, str], ...], amounts: Iterable[tuple[str, float]]) -> None:
        """Several counters of one label set (``key``: its sorted items) under one lock."""
        with self._lock:
            for name, amount in amounts:
                table = self._values[name]
                table[key] = table.get(key, 0.0) + amount

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values[name].get(tuple(sorted(labels.items())), 0.0)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = {n: dict(v) for n, v in self._values.items()}
        for name, (doc, _) in _TRITON.items():
            metric = Metric(name, doc, "unknown")
            for key, v in snapshot[name].items():
                metric.add_sample(name, dict(key), v)
            yield metric


class ServingMetrics:
    """The metrics of one model served by one process (thread-safe)."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None):
        self.model = model
        self.registry = registry if registry is not None else CollectorRegistry()
        self.triton = _TritonCounters()
        self.registry.register(self.triton)
        r = self.registry
        self.batch_size = Histogram(
            "recserve_batch_size",
            "Requests per forward",
            ["model"],
            registry=r,
            buckets=_BATCH_BUCKETS,
        )
        self.failures = Counter(
            "recserve_request_failures",
            "Calls refused or failed, by serving.types.error_status reason",
            ["model", "reason"],
            registry=r,
        )
        self.latency = Histogram(
            "recserve_request_duration_seconds",
            "Request duration from submit to answer",
            ["model"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.version = Gauge(
            "recserve_model_version", "Model version served", ["model"], registry=r
        )
        self.reloads = Counter(
            "recserve_model_reloads", "Hot-reload attempts", ["model", "result"], registry=r
        )
        self.waiting = Gauge("recserve_queue_waiting", "Requests queued now", ["model"], registry=r)
        self.updates = Counter(
            "recserve_updates_applied", "Live update batches applied", ["model", "kind"], registry=r
        )
        self.update_failures = Counter(
            "recserve_update_failures",
            "Live update batches refused or failed",
            ["model", "kind", "reason"],
            registry=r,
        )
        self.updates_replayed = Counter(
            "recserve_updates_replayed",
            "Update log records replayed on load",
            ["model"],
            registry=r,
        )
        self.update_sequence = Gauge(
            "recserve_update_sequence",
            "Sequence number of the last update applied to the version served",
            ["model"],
            registry=r,
        )
        self.list_imbalance = Gauge(
            "recserve_index_list_imbalance",
            "Largest IVF list over the mean list size (1: balanced)",
            ["model"],
            registry=r,
        )
        self.rebuild_recommended = Gauge(
            "recserve_index_rebuild_recommended",
            "1 when live updates unbalanced the IVF lists enough that a full rebuild pays off",
            ["model"],
            registry=r,
        )
        self._http: Any = None
        # what every request and batch records, made once (labels() locks and checks every
        # label at each call)
        self._keys: dict[int | None, tuple[tuple[str, str], ...]] = {}
        self._latency = self.latency.labels(model)
        self._batch_size = self.batch_size.labels(model)

    def _labels(self, version: int | None) -> dict[str, str]:
        return {"model": self.model, "version": "" if version is None else str(version)}

    def _key(self, version: int | None) -> tuple[tuple[str, str], ...]:
        """The Triton counters' label key of ``version`` (made once: every request uses it)."""
        key = self._keys.get(version)
        if key is None:
            key = self._keys[version] = tuple(sorted(self._labels(version).items()))
        return key

    # ---- recording ----------------------------------------------------------------------------
    def request_done(self, version: int | None, seconds: float, reason: str | None) -> None:
        """One call (however many rows) finished: ``reason`` None on success, else the
        ``error_status`` reason of its failure."""
        key, us = self._key(version), seconds * 1e6
        if reason is None:
            self.triton.add(
                key, (("nv_inference_request_success", 1), ("nv_inference_request_duration_us", us))
            )
        else:
            triton_reason = TRITON_REASON.get(reason, "OTHER")
            labels = {**self._labels(version), "reason": triton_reason}
            self.triton.inc("nv_inference_request_failure", 1, labels)
            self.failures.labels(self.model, reason).inc()
            self.triton.add(key, (("nv_inference_request_duration_us", us),))
        self._latency.observe(seconds)

    def batch_queued(self, version: int | None, waits: list[float]) -> None:
        """A batch left the queue; ``waits``: each request's queue time (s)."""
        self.triton.add(self._key(version), (("nv_inference_queue_duration_us", sum(waits) * 1e6),))
        self._batch_size.observe(len(waits))

    def batch_computed(self, version: int, size: int, seconds: float) -> None:
        """One forward ran ``size`` rows (of one call or several) in ``seconds``."""
        amounts = (
            ("nv_inference_exec_count", 1),
            ("nv_inference_count", size),
            ("nv_inference_compute_infer_duration_us", seconds * 1e6),
        )
        self.triton.add(self._key(version), amounts)

    def model_loaded(self, version: int) -> None:
        self.version.labels(self.model).set(version)

    def reload(self, ok: bool) -> None:
        self.reloads.labels(self.model, "ok" if ok else "failed").inc()

    def update_applied(self, kind: str, sequence: int) -> None:
        """A live update batch of ``kind`` was applied as number ``sequence`` of its version."""
        self.updates.labels(self.model, kind).inc()
        self.update_sequence.labels(self.model).set(sequence)

    def update_failed(self, kind: str, reason: str) -> None:
        self.update_failures.labels(self.model, kind, reason).inc()

    def replayed(self, records: int, sequence: int) -> None:
        """``records`` log records were replayed onto a loaded version (last: ``sequence``)."""
        self.updates_replayed.labels(self.model).inc(records)
        self.update_sequence.labels(self.model).set(sequence)

    def index_balance(self, imbalance: float, rebuild: bool) -> None:
        self.list_imbalance.labels(self.model).set(imbalance)
        self.rebuild_recommended.labels(self.model).set(1.0 if rebuild else 0.0)

    def watch_queue(self, waiting: Callable[[], int]) -> None:
        """``recserve_queue_waiting`` reads ``waiting()`` at every scrape."""
        self.waiting.labels(self.model).set_function(waiting)

    # ---- exposition ---------------------------------------------------------------------------
    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves ``/metrics`` on ``host:port`` (0: any free port); returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
