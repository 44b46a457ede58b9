"""Replica health as pure classes (no gRPC): outlier ejection, probes, back-off, the adaptive
hedge delay. The router's use of them over real processes is in test_replica_ejection.py."""

from __future__ import annotations

import math
import re

import pytest

from common.config import ConfigError
from serving.sharding.config import RouterConfig
from serving.sharding.health import Change, Ejection, LatencyWindow

SHARDS = [["a", "b"], ["c"]]


def policy(after: int = 2) -> Ejection:
    return Ejection(SHARDS, after=after, base_s=1.0, max_s=5.0)


def test_replicas_in_rotation_take_turns():
    e = policy()
    assert e.order(0, 0, 0.0) == (["a", "b"], None)
    assert e.order(0, 1, 0.0) == (["b", "a"], None)
    assert e.order(1, 7, 0.0) == (["c"], None)


def test_consecutive_failures_eject_once_and_an_answer_resets_the_count():
    e = policy(after=2)
    assert e.failed(0, "a", 0.0) is None
    assert e.succeeded(0, "a") is None  # not in a row
    assert e.failed(0, "a", 0.0) is None
    assert e.failed(0, "a", 0.0) is Change.EJECTED
    assert e.in_rotation(0) == 1 and e.is_ejected(0, "a")
    assert e.failed(0, "a", 0.1) is None  # already out: no second ejection
    for turn in range(2):  # the healthy replica first, the ejected one as a last resort
        assert e.order(0, turn, 0.5) == (["b", "a"], None)


def test_after_the_back_off_one_probe_and_an_answer_brings_it_back():
    e = policy(after=1)
    assert e.failed(0, "a", 0.0) is Change.EJECTED
    assert e.order(0, 0, 0.99) == (["b", "a"], None)  # back-off (1 s) not over
    assert e.order(0, 0, 1.0) == (["b"], "a")  # the probe: a copy, left out of the order
    assert e.order(0, 1, 1.1) == (["b", "a"], None)  # one probe at a time
    assert e.succeeded(0, "a") is Change.RETURNED
    assert e.in_rotation(0) == 2 and e.order(0, 0, 1.2) == (["a", "b"], None)


def test_a_failed_probe_doubles_the_back_off_up_to_the_ceiling():
    e = policy(after=1)
    assert e.failed(0, "a", 0.0) is Change.EJECTED
    now, backoffs = 0.0, []
    for _ in range(5):
        due = next(t / 100 for t in range(int(now * 100), 10_000) if e.order(0, 0, t / 100)[1])
        backoffs.append(round(due - now, 2))
        now = due
        assert e.failed(0, "a", now) is None  # the probe failed: out again, longer
    assert backoffs == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert e.succeeded(0, "a") is Change.RETURNED
    assert e.failed(0, "a", 100.0) is Change.EJECTED  # the back-off starts over
    assert e.order(0, 0, 101.0)[1] == "a"


def test_a_shard_with_every_replica_out_is_still_asked_and_needs_no_probe():
    e = policy(after=1)
    assert e.failed(1, "c", 0.0) is Change.EJECTED
    assert e.order(1, 0, 10.0) == (["c"], None)  # asked anyway: no replica in rotation
    assert e.succeeded(1, "c") is Change.RETURNED
    assert e.failed(0, "a", 0.0) is Change.EJECTED and e.failed(0, "b", 0.5) is Change.EJECTED
    assert e.order(0, 1, 0.6) == (["a", "b"], None)  # soonest back first


def test_an_abandoned_probe_is_probed_again():
    e = policy(after=1)
    e.failed(0, "a", 0.0)
    assert e.order(0, 0, 1.0)[1] == "a"
    e.abandoned(0, "a")
    assert e.order(0, 0, 1.0)[1] == "a"


def test_zero_never_ejects():
    e = policy(after=0)
    for _ in range(100):
        assert e.failed(0, "a", 0.0) is None
    assert e.in_rotation(0) == 2


def test_the_hedge_delay_is_the_bounded_p95_of_recent_answers():
    w = LatencyWindow(low_s=0.005, high_s=0.1, size=100, warm=20)
    assert w.hedge_after() == 0.1  # too few answers yet: the ceiling
    for i in range(100):
        w.add(0.001 * (i + 1))  # 1..100 ms
    assert w.hedge_after() == pytest.approx(0.095)
    for _ in range(100):
        w.add(0.0001)
    assert w.hedge_after() == 0.005  # the floor
    for _ in range(100):
        w.add(1.0)
    assert w.hedge_after() == 0.1  # the ceiling: a twin still has time
    assert not math.isinf(w.hedge_after())


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hedge_min_ms": 200.0}, "router.hedge_min_ms: must be <= hedge_max_ms (100)"),
        ({"eject_base_ms": 20_000.0}, "router.eject_base_ms: must be <= eject_max_ms (10000)"),
    ],
)
def test_router_config_refuses_a_lower_bound_above_its_upper(fields, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        RouterConfig(shards=[["h:1", "h:2"]], **fields).validate()


def test_router_config_defaults_eject_after_two_failures_and_hedge_adaptively():
    cfg = RouterConfig(shards=[["h:1", "h:2"]])
    assert (cfg.eject_after_failures, cfg.hedge, cfg.hedge_after_ms) == (2, "adaptive", 0.0)
    with pytest.raises(ConfigError, match="eject_after_failures"):
        RouterConfig(shards=[["h:1"]], eject_after_failures=-1)
