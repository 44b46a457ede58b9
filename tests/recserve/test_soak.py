"""`recserve soak`: a short real run in CI (a local cluster of 6 processes on 127.0.0.1, open-loop
load, v2 published and a shard replica restarted mid-run), and the checks on made-up reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recserve.soak import SoakSpec, check

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_short_soak_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    run = subprocess.run(
        [
            sys.executable, "-m", "recserve", "test", "soak", "--seconds", "12", "--qps", "25",
            "--items", "5000", "--max-p99-ms", "2000", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "soak.json").read_text())
    assert report["problems"] == []
    assert report["errors"] == {} and report["partial"] == 0
    assert report["ok"] == report["requests"] >= 0.95 * 25 * 12
    assert report["router_successes"] == report["ok"]  # the server counted every answer once
    assert report["first_v2_answer_s"] is not None  # the hot reload reached the router
    assert report["events"]["replica_ready_s"] > report["events"]["stop_replica_s"]
    assert report["phases"]["restart"]["n"] > 0  # calls were in flight during the restart
    print(run.stdout)


def good_report() -> dict:
    return {
        "requests": 100, "ok": 100, "errors": {}, "partial": 0, "achieved_qps": 10.0,
        "latency": {"n": 100, "p99_ms": 50.0}, "first_v2_answer_s": 4.0,
        "router_successes": 100.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"errors": {"UNAVAILABLE": 1}, "ok": 99, "router_successes": 99.0}, "calls failed"),
        ({"partial": 2}, "partial"),
        ({"latency": {"n": 100, "p99_ms": 300.0}}, "p99"),
        ({"latency": {"n": 0}}, "p99"),
        ({"first_v2_answer_s": None}, "never served v2"),
        ({"router_successes": 101.0}, "the router counted 101"),
        ({"achieved_qps": 9.0}, "generator"),
    ],
)
def test_each_broken_promise_is_reported(change: dict, says: str) -> None:
    spec = SoakSpec(seconds=10, qps=10, out=Path("unused"), max_p99_ms=250)
    assert check(spec, good_report()) == []
    problems = check(spec, {**good_report(), **change})
    assert len(problems) == 1 and says in problems[0], problems


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"seconds": 3}, "--seconds"),
        ({"qps": 0}, "--qps"),
        ({"replicas": 1}, "--replicas"),
        ({"items": 10}, "--items"),
    ],
)
def test_bad_options_are_named(kwargs: dict, names: str) -> None:
    spec = SoakSpec(**{"seconds": 10, "qps": 10, "out": Path("unused"), **kwargs})
    with pytest.raises(ValueError, match=names):
        spec.validate()
