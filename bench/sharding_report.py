"""bench/sharding.py's results as ratios and markdown: each case against one shard and the
in-process model, the equality checks, and where a routed request's time goes."""

from __future__ import annotations

from typing import Any

from timing import cell

SCORE_ATOL = 1e-4
"""Largest score difference the routed-vs-in-process check accepts."""


def add_ratios(results: dict[str, Any]) -> None:
    """q/s vs 1 shard (same filter and concurrency), p50 vs the in-process single call and q/s
    vs in-process batched throughput (same filter)."""
    base = {r["filter"]: r for r in results["inprocess"]}
    one = {
        (r["filter"], r["concurrency"]): r["qps"] for r in results["cluster"] if r["shards"] == 1
    }
    for r in results["cluster"]:
        ref = one.get((r["filter"], r["concurrency"]))
        r["qps_vs_1_shard"] = r["qps"] / ref if ref else None
        r["p50_vs_inprocess"] = r["p50_ms"] / base[r["filter"]]["p50_ms"]
        r["qps_vs_inprocess_batched"] = r["qps"] / base[r["filter"]]["batched_qps"]


def render(results: dict[str, Any]) -> str:
    """The two markdown tables: load cases, then the latency breakdown at concurrency 1."""
    lines = [
        "| S | concurrency | filter | q/s | p50 ms | p99 ms | partial | errors | "
        "q/s vs 1 shard | p50 vs in-process | q/s vs in-process batched |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["inprocess"]:
        lines.append(
            f"| in-process | 1 | {r['filter']} | {1e3 / r['p50_ms']:.0f} (1/p50) | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | — | — | — | 1.00 | — |"
        )
        lines.append(
            f"| in-process | batch {r['batch']} | {r['filter']} | {r['batched_qps']:.0f} | — | — "
            "| — | — | — | — | 1.00 |"
        )
    for r in results["cluster"]:
        lines.append(
            f"| {r['shards']} | {r['concurrency']} | {r['filter']} | {r['qps']:.0f} | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['partial']} | "
            f"{sum(r['errors'].values())} | {cell(r['qps_vs_1_shard'], '.2f')} | "
            f"{r['p50_vs_inprocess']:.2f} | {r['qps_vs_inprocess_batched']:.2f} |"
        )
    lines += ["", *render_breakdown(results), "", render_checks(results)]
    return "\n".join(lines)


def render_checks(results: dict[str, Any]) -> str:
    """One line: per S, whether every checked routed answer equals the in-process forward."""
    by_s: dict[int, bool] = {}
    for c in results.get("checks", []):
        by_s[c["shards"]] = by_s.get(c["shards"], True) and c["equal"]
    users = max((c["users"] for c in results.get("checks", [])), default=0)
    parts = ", ".join(f"S={s} equal: {str(ok).lower()}" for s, ok in sorted(by_s.items()))
    return (
        f"Routed == in-process forward ({users} users x every filter; ids equal, scores within "
        f"{SCORE_ATOL:g}): {parts or 'not checked'}"
    )


def render_breakdown(results: dict[str, Any]) -> list[str]:
    """p50 ms of one request, from the in-process forward to the real cluster, per S and filter."""
    base = {r["filter"]: r["p50_ms"] for r in results["inprocess"]}
    delays = sorted({r["queue_delay_ms"] for r in results.get("inprocess_router", [])})

    def p50(kind: str, s: int, label: str, **match: Any) -> float | None:
        for r in results.get(kind, []):
            if (
                r["shards"] == s
                and r["filter"] == label
                and all(r[k] == v for k, v in match.items())
            ):
                return r["p50_ms"]
        return None

    lines = [
        "| S | filter | in-process forward | local merge (no gRPC) | "
        + "".join(f"in-process router, queue delay {d:g} ms | " for d in delays)
        + "cluster, 1 client | cluster − in-process | cluster / in-process |",
        "|---|---|---|---|" + "---|" * len(delays) + "---|---|---|",
    ]
    for s in results["config"]["shards"]:
        for label, b in base.items():
            c = p50("cluster", s, label, concurrency=1)
            lines.append(
                f"| {s} | {label} | {b:.2f} | {cell(p50('local_merge', s, label), '.2f')} | "
                + "".join(
                    f"{cell(p50('inprocess_router', s, label, queue_delay_ms=d), '.2f')} | "
                    for d in delays
                )
                + f"{cell(c, '.2f')} | "
                f"{cell(None if c is None else c - b, '+.2f')} | "
                f"{cell(None if c is None else c / b, '.2f')} |"
            )
    return lines
