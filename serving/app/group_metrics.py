"""One ``/metrics`` for a group of serving processes: the parent scrapes each member's own."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 2.0


class ProcessMetrics:
    """A Prometheus collector: every process's ``/metrics``, each sample labelled
    ``process="<slot>"`` (``engine`` for a split group's engine); a process that does not
    answer (restarting) is left out of that scrape."""

    def __init__(self, addresses: Callable[[], dict[str, str]]):
        self.addresses = addresses

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for slot, address in sorted(self.addresses().items()):
            try:
                with urllib.request.urlopen(
                    f"http://{address}/metrics", timeout=SCRAPE_TIMEOUT_S
                ) as reply:
                    text = reply.read().decode()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                out = families.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = out
                for s in family.samples:
                    labels = {**s.labels, "process": slot}
                    out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from families.values()
