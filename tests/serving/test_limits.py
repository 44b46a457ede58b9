"""``serving/limits.py``: each request size limit, checked before the filter is parsed, refused
naming the field and the limit; ``[limits]`` in serve.toml."""

from __future__ import annotations

import time

import pytest

from serving.app.config import ConfigError, ServeConfig
from serving.limits import LimitsConfig
from serving.types import RequestError

LIMITS = LimitsConfig(max_filter_bytes=100, max_filter_clauses=3, max_filter_set_values=4)


def test_a_filter_within_the_limits_parses():
    clauses = LIMITS.parse_filter("a and b and c in {1, 2, 3, 4}")
    assert [c.attribute for c in clauses.children] == ["a", "b", "c"]
    assert LIMITS.parse_filter("") is None and LIMITS.parse_filter(None) is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("a" * 101, "filter: 101 bytes is over the limit of 100 (limits.max_filter_bytes)"),
        ("é" * 51, "filter: 102 bytes is over the limit of 100 (limits.max_filter_bytes)"),
        ("a and b and c and d", "filter: more than 3 clauses (limits.max_filter_clauses)"),
        (
            "c in {1, 2, 3, 4, 5}",
            "filter: the set of c holds more than 4 values (limits.max_filter_set_values)",
        ),
    ],
)
def test_each_limit_is_refused_naming_the_field(text, message):
    with pytest.raises(RequestError) as e:
        LIMITS.parse_filter(text, " (batch row 2)")
    assert str(e.value) == message + " (batch row 2)"


def test_a_syntax_error_is_still_a_filter_error():
    with pytest.raises(RequestError, match=r"^filter: expected"):
        LIMITS.parse_filter("a in {")


def test_a_huge_filter_is_refused_in_microseconds_not_seconds():
    huge = " and ".join(["category in {news, sports, music}"] * 10_000)  # ~350 KB
    defaults = LimitsConfig()
    start = time.perf_counter()
    for _ in range(10):
        with pytest.raises(RequestError, match=r"limits\.max_filter_bytes"):
            defaults.parse_filter(huge)
    assert (time.perf_counter() - start) / 10 < 0.005  # unbounded it took ~0.7 s to parse alone
    many = " and ".join(["a"] * 3000)  # 17 KB of clauses under a raised byte limit
    raised = LimitsConfig(max_filter_bytes=1 << 20)
    start = time.perf_counter()
    with pytest.raises(RequestError, match=r"limits\.max_filter_clauses"):
        raised.parse_filter(many)
    assert time.perf_counter() - start < 0.05  # parsing stops at clause 65


def test_limits_come_from_serve_toml_and_bad_values_name_the_key(tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.pbtxt").write_text('name: "demo"\n')
    data = {"model_repo": str(tmp_path), "limits": {"max_filter_clauses": 8}}
    cfg = ServeConfig.from_dict(data, where="serve.toml")
    assert cfg.limits.max_filter_clauses == 8 and cfg.limits.max_filter_bytes == 16384
    assert cfg.limits.http_body_timeout_s == 10.0
    for key, value, why in [
        ("max_filter_bytes", 0, "must be in [1, 1073741824], got 0"),
        ("http_body_timeout_s", 0.0, "must be > 0"),
        ("max_filters", 1, "unknown key"),
    ]:
        with pytest.raises(ConfigError) as e:
            ServeConfig.from_dict({**data, "limits": {key: value}}, where="serve.toml")
        assert str(e.value).startswith(f"serve.toml: limits.{key}: {why}")


def test_a_seen_list_over_max_seen_is_refused_naming_the_field():
    limits = LimitsConfig(max_seen=3)
    limits.check_seen(3)  # at the limit: taken
    with pytest.raises(RequestError) as e:
        limits.check_seen(4, "raw_seen", " (batch row 1)")
    assert str(e.value) == (
        "raw_seen: 4 item ids is over the limit of 3 (limits.max_seen) (batch row 1)"
    )
    assert LimitsConfig().max_seen == 100_000
    with pytest.raises(ConfigError, match=r"limits\.max_seen: must be in \[0, 16777216\], got -1"):
        ServeConfig.from_dict({"limits": {"max_seen": -1}}, where="serve.toml")
