"""bench/ann_rounds.py: each chosen setting is timed against each peer's in turns, the state it
was swept under restored first, and the ratios are per round (ours ÷ peer), then their median."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import ann_rounds
from ann_report import Point


def point(system: str, setting: str, recall: float, qps: float) -> Point:
    return Point(system, setting, "none", 1.0, recall, qps, qps, 0.1, 0.2, 64.0)


@pytest.fixture
def timed(monkeypatch):
    """Timers that return what the searchers say, and a log of the turns."""
    log: list[str] = []
    monkeypatch.setattr(ann_rounds, "time_batched", lambda fn, repeats: (None, fn(), []))
    monkeypatch.setattr(ann_rounds, "time_single", lambda fn, n: (fn(0), 0.0))
    return log


def test_rounds_alternate_and_report_the_median_of_per_round_ratios(timed):
    ours_s = iter([0.010, 0.020, 0.010])  # batched seconds, round by round
    peer_s = iter([0.030, 0.030, 0.060])
    kept = ann_rounds.Kept()
    kept.keep(
        "ours-int8", "none", "nprobe=2", lambda: next(ours_s), lambda i: 0.05,
        lambda: timed.append("ours"),
    )  # fmt: skip
    kept.keep(
        "faiss-IVF-SQ8", "none", "nprobe=4", lambda: next(peer_s), lambda i: 0.10,
        lambda: timed.append("peer"),
    )  # fmt: skip
    kept.keep("ours-int8", "none", "nprobe=1", None, None, None)  # below the target: not chosen
    points = [
        point("ours-int8", "nprobe=1", 0.90, 9e4),
        point("ours-int8", "nprobe=2", 0.97, 5e4),
        point("faiss-IVF-SQ8", "nprobe=4", 0.96, 3e4),
        point("ours-int8-bound0", "nprobe=2", 0.99, 9e4),  # a bound variant: never paired
    ]
    args = argparse.Namespace(rounds=3, repeats=1, single=5, queries=1000)
    rows = ann_rounds.head_to_head(points, kept, ["none"], {"none": [0.95]}, args)
    assert timed == ["ours", "peer", "peer", "ours", "ours", "peer"]  # who goes first alternates
    (row,) = rows
    assert (row["ours_setting"], row["peer_setting"]) == ("nprobe=2", "nprobe=4")
    assert row["qps_ratios"] == pytest.approx([3.0, 1.5, 6.0])
    assert row["qps_ratio_median"] == pytest.approx(3.0)
    assert row["p50_ratio_median"] == pytest.approx(2.0)  # 0.10 ms ÷ 0.05 ms
    table = ann_rounds.rounds_table(rows, args)
    assert "**3.00×** (1.50–6.00)" in table and "3 rounds in turns" in table


def test_build_rounds_alternate_and_report_the_median_ratio():
    turns: list[str] = []
    ours_s, peer_s = iter([1.0, 3.0, 2.0]), iter([2.0, 2.0, 2.0])

    def ours() -> float:
        turns.append("ours")
        return next(ours_s)

    def peer() -> float:
        turns.append("peer")
        return next(peer_s)

    row = ann_rounds.build_rounds(3, ours, peer)
    assert turns == ["ours", "peer", "peer", "ours", "ours", "peer"]
    assert row["ratios"] == pytest.approx([0.5, 1.5, 1.0]) and row["ratio_median"] == 1.0
    table = ann_rounds.build_rounds_table(row, (0.3, 0.2))
    assert "median **1.00** (0.50–1.50)" in table and "(1.50)" in table
