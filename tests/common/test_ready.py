"""The ready line (``common/ready.py``): what a server prints is what a reader parses; log lines
and other JSON are skipped; a ready event with a wrongly typed field is refused by name."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.ready import ReadyLine, announce, parse_ready, ready_line


def test_announce_prints_one_json_line_that_parses_back(capsys):
    printed = announce(
        "shard", grpc="127.0.0.1:8001", metrics="127.0.0.1:9100", model="demo", version=3,
        security="tls", shard=1, num_shards=2,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.endswith("\n")
    assert json.loads(out)["event"] == "ready"
    got = parse_ready(out)
    assert got == printed
    assert (got.role, got.grpc, got.http, got.metrics) == (
        "shard", "127.0.0.1:8001", None, "127.0.0.1:9100"
    )  # fmt: skip
    assert (got.model, got.version, got.processes, got.security) == ("demo", 3, 1, "tls")
    assert dict(got.extras) == {"shard": 1, "num_shards": 2}
    assert got.pid > 0


@pytest.mark.parametrize(
    "line",
    [
        "",
        "2024-01-01 12:00:00 INFO serving.app.main: drained; bye",
        "serving demo v1 grpc=127.0.0.1:1 http=off metrics=off",
        "{not json",
        '{"event": "started", "role": "serve", "pid": 1}',
        "[1, 2]",
        '"ready"',
    ],
)
def test_lines_that_are_not_a_ready_event_are_skipped(line):
    assert parse_ready(line) is None


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"role": "serve"}, "pid"),
        ({"role": "serve", "pid": "12"}, "pid"),
        ({"role": 3, "pid": 12}, "role"),
        ({"role": "serve", "pid": 12, "grpc": 8001}, "grpc"),
        ({"role": "serve", "pid": 12, "version": "3"}, "version"),
        ({"role": "serve", "pid": 12, "processes": 0}, "processes"),
        ({"role": "serve", "pid": 12, "security": None}, "security"),
    ],
)
def test_a_ready_event_with_a_wrongly_typed_field_names_it(fields, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        parse_ready(json.dumps({"event": "ready", **fields}))


def test_announce_refuses_what_readers_could_not_parse():
    with pytest.raises(ValueError, match=r"^extras: not JSON"):
        ready_line("serve", tables={1, 2})
    with pytest.raises(ValueError, match=r"^event:"):
        ready_line("serve", event="other")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
addresses = st.none() | st.text()


@given(
    role=st.text(min_size=1),
    pid=st.integers(min_value=1, max_value=2**31),
    grpc=addresses,
    http=addresses,
    metrics=addresses,
    model=addresses,
    version=st.none() | st.integers(),
    processes=st.integers(min_value=1, max_value=10_000),
    security=st.text(),
    extras=st.dictionaries(st.text().filter(lambda k: k not in {"event", "role", "pid"}),
                           json_values, max_size=4),
)  # fmt: skip
def test_any_field_values_round_trip_on_one_line(
    role, pid, grpc, http, metrics, model, version, processes, security, extras
):
    common = {"grpc": grpc, "http": http, "metrics": metrics, "model": model, "version": version,
              "processes": processes, "security": security}  # fmt: skip
    extras = {k: v for k, v in extras.items() if k not in common}
    line = ready_line(role, pid, **common, **extras)
    text = line.to_json()
    assert "\n" not in text and "\r" not in text
    assert parse_ready(text + "\n") == line == ReadyLine(role, pid, **common, extras=extras)
    assert parse_ready(text.encode()) == line
