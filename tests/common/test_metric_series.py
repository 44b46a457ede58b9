"""common/metric_series.py: a labelled metric's children, made once per label set."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from common.metric_series import Series


def test_each_label_set_gets_its_own_series_made_once():
    registry = CollectorRegistry()
    counter = Counter("calls", "Calls", ["model", "code"], registry=registry)
    series = Series(counter)
    assert series("demo", "OK") is series("demo", "OK")
    assert series("demo", "OK") is not series("demo", "INTERNAL")
    series("demo", "OK").inc()
    series("demo", "OK").inc()
    series("demo", "INTERNAL").inc()
    assert registry.get_sample_value("calls_total", {"model": "demo", "code": "OK"}) == 2.0
    assert registry.get_sample_value("calls_total", {"model": "demo", "code": "INTERNAL"}) == 1.0
