"""Labelled Prometheus metrics on hot paths: each label set's series made once.

``metric.labels(...)`` looks its child up under a lock and checks every label at every call,
and a served request records several series. :class:`Series` keeps the children it
made, keyed by their label values::

    answers = Series(Counter("answers", "Answers", ["model", "shard"]))
    answers("demo", "0").inc()
"""

from __future__ import annotations

from typing import Any


class Series:
    """The children of a labelled metric by label values (positional, in its label order)."""

    def __init__(self, metric: Any):
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child
