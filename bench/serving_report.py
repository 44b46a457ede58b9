"""bench/serving.py's results as a verdict and markdown: the best row under the p99 budget per
system, ours against each baseline's target, every load case, latency against catalog size."""

from __future__ import annotations

from typing import Any

from timing import cell

TARGETS = {"noop": 0.5, "naive": 3.0, "triton": 1.0}
"""ours / system: the targets for max q/s at p99 <= budget."""
SPLIT_TARGETS = {"noop": 0.6, "ours": 1.5}
"""ours-split (one engine, front-end processes) / system: its targets for max q/s."""
PROTOCOL = {"noop": "recommend", "naive": "recommend", "triton": "kserve", "ours": "recommend",
            "ours-1proc": "recommend", "ours-kserve": "kserve", "ours-split": "recommend"}  # fmt: skip
"""The protocol each system is driven with (and compared on)."""


def best_under_budget(rows: list[dict[str, Any]], budget_ms: float) -> dict[str, Any] | None:
    """The error-free row with the highest q/s among those with p99 <= ``budget_ms``."""
    fit = [r for r in rows if not r["errors"] and r["p99_ms"] <= budget_ms]
    return max(fit, key=lambda r: r["qps"], default=None)


def summarize(results: dict[str, Any], budget_ms: float) -> dict[str, Any]:
    """Per system: its best row under the budget; ratios of ours to each baseline vs targets."""
    best = {s: best_under_budget(v["rows"], budget_ms) for s, v in results["systems"].items()}
    ours = best.get("ours")
    ratios = {}
    for base, target in TARGETS.items():
        b = best.get(base)
        ratio = ours["qps"] / b["qps"] if ours and b else None
        ratios[base] = {"ratio": ratio, "target": target,
                        "met": None if ratio is None else ratio >= target}  # fmt: skip
    split = best.get("ours-split")
    for base, target in SPLIT_TARGETS.items():
        b = best.get(base)
        if split and b:
            r = split["qps"] / b["qps"]
            ratios[f"split / {base}"] = {"ratio": r, "target": target, "met": r >= target}
    if best.get("ours-kserve") and best.get("triton"):
        r = best["ours-kserve"]["qps"] / best["triton"]["qps"]
        ratios["triton (both KServe)"] = {"ratio": r, "target": 1.0, "met": r >= 1.0}
    return {"best": best, "ratios": ratios}


def render(results: dict[str, Any]) -> str:
    """Markdown: headline (best under budget + ratios), every load case, catalog sizes."""
    budget = results["config"]["p99_ms"]
    summary = results["summary"]
    lines = [
        f"| system | protocol | max q/s at p99 ≤ {budget:g} ms | at concurrency | p50 ms | p99 ms "
        "| ours / system | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s, v in results["systems"].items():
        b = summary["best"].get(s)
        r = summary["ratios"].get(s, {})
        met = {True: "yes", False: "**no**", None: "—"}[r.get("met")]
        why = f"skipped: {v['skipped'].splitlines()[0][:80]}" if v.get("skipped") else "none fits"
        lines.append(
            f"| {s} | {PROTOCOL[s]} | {cell(b and b['qps'], '.0f') if b else why} | "
            f"{b['concurrency'] if b else '—'} | {cell(b and b['p50_ms'], '.2f')} | "
            f"{cell(b and b['p99_ms'], '.2f')} | {cell(r.get('ratio'), '.2f')} | "
            f"{'≥ ' + format(r['target'], 'g') + '×' if r else '—'} | {met if r else '—'} |"
        )
    for base in SPLIT_TARGETS:
        if (r := summary["ratios"].get(f"split / {base}")) is not None:
            met = "met" if r["met"] else "**not met**"
            lines.append(
                f"\nours-split / {base}: {r['ratio']:.2f} (target ≥ {r['target']:g}×: {met})"
            )
    if (r := summary["ratios"].get("triton (both KServe)")) is not None:
        lines.append(f"\nours-kserve / triton (same protocol): {r['ratio']:.2f}")
    env = results.get("environment", {})
    if env.get("filter"):
        lines.append(
            f"\nevery request filtered: `{env['filter']}` "
            f"(passes {env['filter_passes']:.2%} of the catalog)"
        )
    lines += ["", *render_cases(results), "", *render_sizes(results)]
    return "\n".join(lines)


def render_cases(results: dict[str, Any]) -> list[str]:
    """One row per (system, concurrency)."""
    lines = [
        "| system | concurrency | q/s | p50 ms | p99 ms | errors | CPU used by others |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, v in results["systems"].items():
        for r in v["rows"]:
            lines.append(
                f"| {s} | {r['concurrency']} | {r['qps']:.0f} | {r['p50_ms']:.2f} | "
                f"{r['p99_ms']:.2f} | {sum(r['errors'].values())} | {r['other_load']:.0%} |"
            )
    return lines


def render_sizes(results: dict[str, Any]) -> list[str]:
    """Ours: latency vs catalog size."""
    lines = [
        "| items | nlist / nprobe | in-process p50 ms | ours C=1 p50 ms | C=1 p99 ms | "
        "C=8 q/s | C=8 p99 ms | CPU used by others |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["sizes"]:
        lines.append(
            f"| {r['items']:,} | {r['nlist']} / {r['nprobe']} | {r['inprocess_p50_ms']:.2f} | "
            f"{cell(r['c1_p50_ms'], '.2f')} | {cell(r['c1_p99_ms'], '.2f')} | "
            f"{cell(r['c8_qps'], '.0f')} | {cell(r['c8_p99_ms'], '.2f')} | {r['other_load']:.0%} |"
        )
    return lines
