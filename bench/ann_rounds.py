"""Head-to-head rounds for ``bench/ann.py --rounds N``: ratios that outlast the machine's drift.

The sweeps measure one system after another, so a slow minute on this shared machine lands on
whichever system was measuring then (one 256-d run read faiss IVF-SQ8 at 35k q/s and the next at
58k on the same code). After the sweeps, each of our systems' chosen setting (the cheapest that
reaches a recall target) and each peer's are timed again in turns, ``N`` rounds, alternating
which goes first; every round gives one ratio per pair, and the table reports their median and
range. The searchers are the sweep's own (``Searcher`` factories kept by :class:`Kept`), each
with a ``prepare`` that restores the state it was swept under (our rerank, filter bound, int8
path).

``--build-rounds N`` does the same for the builds: our index and faiss IVF-SQ8 (k-means + SQ8
training + add) built again in turns, ``N`` rounds, the ratio of each round's times (ours ÷
faiss: < 1 means ours builds faster) and their median, beside the first build of each in the
process (which pays its libraries' first-use costs).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from ann_report import Point, best_at, systems_in
from timing import time_batched, time_single

PEERS = ("faiss-IVF-SQ8", "exact-eligible")
"""The peers the issue's targets name: SQ8 unfiltered and filtered (with its bitmap), and the
exact scan of precomputed eligible ids."""


@dataclass
class Kept:
    """The searchers a sweep measured, by ``(system, filter label, setting)``: ``(batch, one,
    prepare)``, ``prepare()`` setting the state the setting was swept under."""

    searchers: dict[tuple[str, str, str], tuple[Callable, Callable, Callable[[], None]]] = field(
        default_factory=dict
    )

    def keep(self, system: str, label: str, setting: str, batch, one, prepare) -> None:
        self.searchers[(system, label, setting)] = (batch, one, prepare)


def head_to_head(
    points: list[Point], kept: Kept, labels: list[str], targets: dict[str, list[float]], args
) -> list[dict]:
    """For every filter label and recall target: each of our systems against each peer present,
    ``args.rounds`` rounds in turns -> rows with the median and range of the per-round ratios
    (ours ÷ peer: batched q/s, and 1/p50 of one query)."""
    rows = []
    systems = systems_in(points)
    ours = [s for s in systems if s.startswith("ours") and "-bound" not in s]
    peers = [s for s in systems if s in PEERS]
    for label in labels:
        for target in targets[label]:
            for mine in ours:
                a = best_at(points, mine, label, target)
                for peer in peers:
                    b = best_at(points, peer, label, target)
                    if a is None or b is None:
                        continue
                    rows.append(_pair(kept, label, target, a, b, args))
    return rows


def _pair(kept: Kept, label: str, target: float, a: Point, b: Point, args) -> dict:
    sides = [kept.searchers[(p.system, label, p.setting)] for p in (a, b)]
    qps: list[list[float]] = [[], []]
    p50: list[list[float]] = [[], []]
    for r in range(args.rounds):
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            batch, one, prepare = sides[side]
            prepare()
            _, median_s, _ = time_batched(batch, repeats=args.repeats)
            qps[side].append(args.queries / median_s)
            p50[side].append(time_single(one, n=args.single)[0])
    q_ratio = [x / y for x, y in zip(qps[0], qps[1], strict=True)]
    l_ratio = [y / x for x, y in zip(p50[0], p50[1], strict=True)]
    return {
        "filter": label,
        "target": target,
        "ours": a.system,
        "ours_setting": a.setting,
        "peer": b.system,
        "peer_setting": b.setting,
        "qps_ratio_median": statistics.median(q_ratio),
        "qps_ratios": q_ratio,
        "p50_ratio_median": statistics.median(l_ratio),
        "p50_ratios": l_ratio,
        "ours_qps": qps[0],
        "peer_qps": qps[1],
        "ours_p50_ms": p50[0],
        "peer_p50_ms": p50[1],
    }


def rounds_table(rows: list[dict], args: argparse.Namespace) -> str:
    """The head-to-head rows as markdown."""
    if not rows:
        return ""
    out = [
        f"**Head to head: {args.rounds} rounds in turns** (each round times both sides' chosen "
        "settings again, alternating which goes first; median of the per-round ratios, range in "
        "brackets; > 1: ours is faster)",
        "",
        "| filter | recall ≥ | ours (setting) | peer (setting) | q/s ratio | 1/p50 ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        q, lat = r["qps_ratios"], r["p50_ratios"]
        out.append(
            f"| {r['filter']} | {r['target']:.2f} | {r['ours']} ({r['ours_setting']}) | "
            f"{r['peer']} ({r['peer_setting']}) | **{r['qps_ratio_median']:.2f}×** "
            f"({min(q):.2f}–{max(q):.2f}) | **{r['p50_ratio_median']:.2f}×** "
            f"({min(lat):.2f}–{max(lat):.2f}) |"
        )
    return "\n".join(out) + "\n"


def build_rounds(
    rounds: int, build_ours: Callable[[], float], build_peer: Callable[[], float]
) -> dict:
    """``rounds`` builds of each side in turns (who goes first alternates; each callable builds
    and returns its seconds) -> their times, the per-round ratios ours ÷ peer and the median."""
    times: list[list[float]] = [[], []]
    builders = (build_ours, build_peer)
    for r in range(rounds):
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            times[side].append(builders[side]())
    ratios = [a / b for a, b in zip(times[0], times[1], strict=True)]
    return {
        "ours_s": times[0],
        "peer_s": times[1],
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
    }


def build_rounds_table(row: dict, first: tuple[float, float] | None) -> str:
    """The build rounds as markdown, after the first builds ``first = (ours_s, peer_s)`` (None:
    the sweep built no int8 index of ours)."""
    r, n = row["ratios"], len(row["ratios"])
    text = (
        f"**Builds: {n} rounds in turns** (ours ÷ faiss IVF-SQ8's k-means + add; < 1: ours "
        f"builds faster): median **{row['ratio_median']:.2f}** ({min(r):.2f}–{max(r):.2f}); "
        f"ours {statistics.median(row['ours_s']):.3f} s, faiss {statistics.median(row['peer_s']):.3f}"
        " s (medians)."
    )
    if first is not None:
        text += (
            f" First builds in the process: ours {first[0]:.3f} s, faiss {first[1]:.3f} s "
            f"({first[0] / first[1]:.2f})."
        )
    return text + "\n"
