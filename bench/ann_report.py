"""Measured points, the matched-recall pick, and the markdown tables ``bench/ann.py`` prints.

A :class:`Point` is one (system, setting, filter) measurement. "At matched recall" means: for each
system, the setting with the highest batched q/s among those whose recall@K reaches the target.
Ratios are always ours ÷ peer from the same run: q/s for batches, 1/p50 for single queries, so
a ratio above 1 means ours is faster in both columns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

UNFILTERED = "none"

# Peer figures from /work/shared/ANCHORS.md (1M x 64, IVF4096, 2 threads): q/s in one 1000-query call.
ANCHOR_UNFILTERED = {
    ("faiss-Flat", "exact"): (1.0, 1300.0, None),
    ("faiss-IVF-SQ8", "nprobe=32"): (0.98, 13100.0, 0.20),
    ("faiss-IVF-Flat", "nprobe=32"): (1.00, 7800.0, 0.31),
}
ANCHOR_FILTERED_QPS = {  # at recall@100 >= 0.95
    ("50%", "faiss-IVF-SQ8"): 28700.0,
    ("50%", "faiss-IVF-Flat"): 20800.0,
    ("50%", "exact-eligible"): 280.0,
    ("5%", "faiss-IVF-SQ8"): 12700.0,
    ("5%", "faiss-IVF-Flat"): 10800.0,
    ("5%", "exact-eligible"): 3400.0,
    ("0.5%", "faiss-IVF-SQ8"): 5700.0,
    ("0.5%", "faiss-IVF-Flat"): 7000.0,
    ("0.5%", "exact-eligible"): 45000.0,
    ("0.1%", "faiss-IVF-SQ8"): 1800.0,
    ("0.1%", "faiss-IVF-Flat"): 2700.0,
    ("0.1%", "exact-eligible"): 135000.0,
}


@dataclass
class Point:
    """One measurement. ``selectivity`` is the measured fraction of items kept (1.0 unfiltered)."""

    system: str
    setting: str
    filter: str
    selectivity: float
    recall: float
    qps_batch: float  # queries / median of the timed batched runs
    qps_batch_best: float  # queries / fastest run: less sensitive to other load on the machine
    p50_single_ms: float
    p99_single_ms: float
    bytes_per_item: float
    others_cpu: float = 0.0  # share of all cores other processes used while this was measured
    params: dict[str, Any] = field(default_factory=dict)
    batch_runs_s: list[float] = field(default_factory=list)


def best_at(points: list[Point], system: str, filt: str, target: float) -> Point | None:
    """The cheapest (highest batched q/s) setting of ``system`` with recall >= ``target``."""
    ok = [p for p in points if p.system == system and p.filter == filt and p.recall >= target]
    return max(ok, key=lambda p: p.qps_batch, default=None)


def systems_in(points: list[Point]) -> list[str]:
    seen: dict[str, None] = {}
    for p in points:
        seen.setdefault(p.system)
    return list(seen)


def _ours(systems: list[str]) -> list[str]:
    return [s for s in systems if s.startswith("ours")]


def _fmt_qps(v: float) -> str:
    return f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.0f}"


def _best_recall(points: list[Point], system: str, filt: str) -> str:
    mine = [p for p in points if p.system == system and p.filter == filt]
    if not mine:
        return "not run"
    top = max(mine, key=lambda p: p.recall)
    return f"not reached (max {top.recall:.3f} at {top.setting})"


def _ratio(ours: Point | None, peer: Point | None) -> tuple[str, str]:
    if ours is None or peer is None:
        return "—", "—"
    batch = ours.qps_batch / peer.qps_batch
    single = peer.p50_single_ms / ours.p50_single_ms
    return f"{batch:.2f}×", f"{single:.2f}×"


def matched_table(points: list[Point], filt: str, targets: list[float], anchors: bool) -> str:
    """Markdown rows: per target and system, the matched-recall pick and ours÷this ratios."""
    systems = systems_in([p for p in points if p.filter == filt])
    ours_names = _ours(systems) or ["ours"]
    head = [
        "recall ≥",
        "system",
        "setting",
        "recall@K",
        "q/s (batch)",
        "p50 1-query ms",
        "bytes/item",
    ]
    for o in ours_names:
        head += [f"{o} ÷ this, q/s", f"{o} ÷ this, 1/p50"]
    if anchors:
        head.append("ANCHORS q/s")
    head.append("others' CPU")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for target in targets:
        best_ours = {o: best_at(points, o, filt, target) for o in ours_names}
        for s in systems:
            p = best_at(points, s, filt, target)
            row = [f"{target:.2f}", s]
            if p is None:
                row += [_best_recall(points, s, filt), "—", "—", "—", "—"]
            else:
                row += [
                    p.setting,
                    f"{p.recall:.3f}",
                    _fmt_qps(p.qps_batch),
                    f"{p.p50_single_ms:.3f}",
                    f"{p.bytes_per_item:.1f}",
                ]
            for o in ours_names:
                row += list(_ratio(best_ours[o], p)) if not s.startswith("ours") else ["", ""]
            if anchors:
                a = ANCHOR_FILTERED_QPS.get((filt, s))
                row.append(_fmt_qps(a) if a and filt != UNFILTERED else "")
            row.append(f"{p.others_cpu:.0%}" if p else "")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def anchor_check_table(points: list[Point]) -> str:
    """faiss at the exact settings ANCHORS.md quotes, measured now, with ours÷this at recall ≥ 0.98."""
    ours_names = _ours(systems_in(points))
    head = [
        "system",
        "setting",
        "recall (ANCHORS → now)",
        "q/s (ANCHORS → now)",
        "now ÷ ANCHORS",
        "p50 ms (ANCHORS → now)",
    ]
    head += [f"{o}@0.98 ÷ this, q/s" for o in ours_names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (system, setting), (a_rec, a_qps, a_p50) in ANCHOR_UNFILTERED.items():
        p = next(
            (
                x
                for x in points
                if x.system == system and x.setting == setting and x.filter == UNFILTERED
            ),
            None,
        )
        if p is None:
            continue
        row = [
            system,
            setting,
            f"{a_rec:.2f} → {p.recall:.3f}",
            f"{_fmt_qps(a_qps)} → {_fmt_qps(p.qps_batch)}",
            f"{p.qps_batch / a_qps:.2f}×",
            f"{a_p50 if a_p50 is not None else '—'} → {p.p50_single_ms:.3f}",
        ]
        for o in ours_names:
            ours = best_at(points, o, UNFILTERED, 0.98)
            row.append(f"{ours.qps_batch / p.qps_batch:.2f}×" if ours else "—")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render(
    points: list[Point],
    cases: list,
    builds: dict,
    errors: dict,
    args,
    filtered_targets: list[float],
    unfiltered_targets: list[float],
) -> str:
    """The markdown report: one matched-recall table per filter case, the ANCHORS check, builds."""
    anchored = args.n == 1_000_000 and args.nlist == 4096 and args.d == 64 and args.threads == 2
    lines = [
        f"### ANN: {args.n:,} x {args.d} clustered, inner product, K = {args.k}, "
        f"IVF{args.nlist}, {args.threads} threads, {args.queries} queries ({time.strftime('%Y-%m-%d')})",
        "",
        "Ratios are ours ÷ this row, from this run (> 1 means ours is faster): batched q/s, and "
        "1/p50 of single-query latency. Each system at its fastest setting reaching the recall target. "
        "“others' CPU”: share of the machine other processes used while that row was measured "
        "(anything above a few % makes the row suspect).",
        "",
        "**Unfiltered**",
        "",
        matched_table(points, UNFILTERED, unfiltered_targets, anchors=False),
    ]
    prep = (
        "faiss bitmap built outside timing (ours parses its filter string inside):"
        if getattr(args, "filter_strings", False)
        else "faiss bitmap and our compiled filter built outside timing; bitmap:"
    )
    for case in cases[1:]:
        lines += [
            "",
            f"**Filter {case.label}** (`{case.expression}`, measured {case.selectivity:.3%}; "
            f"{prep} {case.prep_ms:.1f} ms)",
            "",
            matched_table(points, case.label, filtered_targets, anchors=anchored),
        ]
    if anchored:
        lines += ["", "**faiss now vs ANCHORS.md** (same settings)", "", anchor_check_table(points)]
    build_txt = ", ".join(f"{k} {v:.1f} s" for k, v in builds.items() if isinstance(v, float))
    lines += ["", f"Build: {build_txt or '—'}."]
    if errors:
        lines += ["", "Errors: " + "; ".join(f"{k}: {v}" for k, v in errors.items())]
    return "\n".join(lines)
