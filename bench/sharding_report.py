"""bench/sharding.py's results as verdicts and markdown: each production configuration (router
over S shards, with or without an embedding server) against ``recserve serve`` on max q/s at
p99 <= budget and on p50 at one client, the CPU every process spent per request, every load case,
the equality checks, and where a routed request's time goes."""

from __future__ import annotations

from typing import Any

from serving_report import best_under_budget
from timing import cell

SCORE_ATOL = 1e-4
"""Largest score difference the routed-vs-in-process check accepts."""
QPS_TARGETS = {(1, 0): 0.8, (2, 0): 0.5, (2, 1): 0.5}
"""(shards, embedding servers) -> the least max q/s at p99 <= budget / serve's (issue 17)."""
P50_TARGETS_MS = {(1, 0): 1.0}
"""(shards, embedding servers) -> the most p50 at 1 client may exceed serve's, in ms."""


def config_name(shards: int, embedding_servers: int) -> str:
    """``serve``, ``1 shard``, ``2 shards + 1 embedding server``."""
    if not shards:
        return "serve"
    name = f"{shards} shard{'s' if shards > 1 else ''}"
    return name + (f" + {embedding_servers} embedding server" if embedding_servers else "")


def _configs(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The (shards, embedding servers) pairs of the load rows, serve first, in run order."""
    return list(dict.fromkeys((r["shards"], r["embedding_servers"]) for r in rows))


def _at(rows: list[dict[str, Any]], concurrency: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["concurrency"] == concurrency), None)


def summarize(results: dict[str, Any], budget_ms: float) -> list[dict[str, Any]]:
    """One verdict per (configuration, filter): its best row under the budget, q/s / serve's
    and p50 at 1 client - serve's against the targets, and the servers' CPU per request there."""
    load = results.get("load", [])
    paired = _paired(load)
    out = []
    for shards, es in _configs(load):
        for label in dict.fromkeys(r["filter"] for r in load):
            rows = [
                r
                for r in load
                if (r["shards"], r["embedding_servers"], r["filter"]) == (shards, es, label)
            ]
            if shards == 0 and paired:
                continue  # serve is each configuration's baseline, in its own turns
            base = _serve_rows(load, label, config_name(shards, es) if paired else None)
            best, base_best = best_under_budget(rows, budget_ms), best_under_budget(base, budget_ms)
            one, base_one = _at(rows, 1), _at(base, 1)
            ratio = best["qps"] / base_best["qps"] if best and base_best else None
            dp50 = one["p50_ms"] - base_one["p50_ms"] if one and base_one else None
            qps_target, p50_target = QPS_TARGETS.get((shards, es)), P50_TARGETS_MS.get((shards, es))
            cpu = (best or {}).get("cpu_ms_per_request", {})
            row = {"config": config_name(shards, es), "shards": shards}
            row |= {"embedding_servers": es, "filter": label, "best": best}
            row |= {"serve_best": base_best, "qps_vs_serve": ratio, "qps_target": qps_target}
            row["qps_met"] = None if ratio is None or qps_target is None else ratio >= qps_target
            row |= {"p50_c1_ms": one and one["p50_ms"], "p50_minus_serve_ms": dp50}
            row["p50_target_ms"] = p50_target
            row["p50_met"] = None if dp50 is None or p50_target is None else dp50 <= p50_target
            row |= {"servers_cpu_ms": cpu.get("servers"), "loadgen_cpu_ms": cpu.get("loadgen")}
            out.append(row)
    return out


def _paired(load: list[dict[str, Any]]) -> bool:
    """Whether serve ran in turns with each configuration (rows with ``pair``)."""
    return any("pair" in r for r in load)


def _serve_rows(load: list[dict[str, Any]], label: str, config: str | None) -> list[dict[str, Any]]:
    """Serve's rows at ``label`` measured in turns with ``config`` (None, for results from
    before the turns: every serve row)."""
    return [
        r
        for r in load
        if r["system"] == "serve"
        and r["filter"] == label
        and (config is None or r.get("pair") == config)
    ]


def add_ratios(results: dict[str, Any]) -> None:
    """Per load row: q/s vs serve's at the same filter and concurrency (the serve row of its
    turns), p50 vs the in-process single call and q/s vs in-process batched throughput."""
    base = {r["filter"]: r for r in results["inprocess"]}
    load = results.get("load", [])
    paired = _paired(load)
    serve = {
        (r.get("pair"), r["filter"], r["concurrency"]): r["qps"]
        for r in load
        if r["system"] == "serve"
    }
    for r in load:
        pair = r.get("pair")
        if paired and r["system"] != "serve":
            pair = config_name(r["shards"], r["embedding_servers"])
        ref = serve.get((pair, r["filter"], r["concurrency"]))
        r["qps_vs_serve"] = r["qps"] / ref if ref else None
        r["p50_vs_inprocess"] = r["p50_ms"] / base[r["filter"]]["p50_ms"]
        r["qps_vs_inprocess_batched"] = r["qps"] / base[r["filter"]]["batched_qps"]


def _met(x: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "—"}[x]


def render(results: dict[str, Any]) -> str:
    """Markdown: verdicts, every load case with CPU per request, breakdown at 1 client, checks."""
    budget = results["config"]["p99_ms"]
    lines = [
        f"| configuration | filter | max q/s at p99 ≤ {budget:g} ms | at C | serve's (its turns) "
        "| q/s / serve | "
        "target | met | p50 at C=1 ms | − serve's | target | met | "
        "servers' CPU ms/request (at max) | load generator's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in results.get("summary", []):
        b, sb = v["best"], v.get("serve_best")
        lines.append(
            f"| {v['config']} | {v['filter']} | {cell(b and b['qps'], '.0f') if b else 'none fits'}"
            f" | {b['concurrency'] if b else '—'} | {cell(sb and sb['qps'], '.0f')} | "
            f"{cell(v['qps_vs_serve'], '.2f')} | "
            f"{'≥ ' + format(v['qps_target'], 'g') + '×' if v['qps_target'] else '—'} | "
            f"{_met(v['qps_met'])} | {cell(v['p50_c1_ms'], '.2f')} | "
            f"{cell(v['p50_minus_serve_ms'], '+.2f')} | "
            f"{'≤ +' + format(v['p50_target_ms'], 'g') + ' ms' if v['p50_target_ms'] else '—'} | "
            f"{_met(v['p50_met'])} | {cell(v['servers_cpu_ms'], '.2f')} | "
            f"{cell(v['loadgen_cpu_ms'], '.2f')} |"
        )
    lines += render_hop_floor(results)
    lines += ["", *render_cases(results), "", *render_breakdown(results)]
    lines += ["", render_checks(results), *render_remote(results)]
    return "\n".join(lines)


def render_hop_floor(results: dict[str, Any]) -> list[str]:
    """One line: the no-op shard hop at 1 client (``hop_floor_case``), when it ran."""
    h = results.get("hop_floor")
    if not h:
        return []
    cpu = h["cpu_ms_per_request"]
    return [
        "",
        f"Shard hop floor (the router's Search, 1 client, to a no-op grpcio shard): p50 "
        f"{h['p50_ms']:.2f} ms, p99 {h['p99_ms']:.2f} ms; CPU per call: that server "
        f"{cell(cpu.get('noop-shard'), '.2f')} ms, the client {cell(cpu.get('loadgen'), '.2f')} ms.",
    ]


def _cpu_cell(cpu: dict[str, float | None]) -> str:
    """``router 0.52, shard-0-0 0.40, loadgen 0.31`` (ms per request), servers' total last."""
    parts = [f"{k} {cell(v, '.2f')}" for k, v in cpu.items() if k not in ("servers", "loadgen")]
    return ", ".join([*parts, f"loadgen {cell(cpu.get('loadgen'), '.2f')}"])


def render_cases(results: dict[str, Any]) -> list[str]:
    """One row per load case; in-process rows first (no serving at all)."""
    lines = [
        "| configuration | C | filter | q/s | p50 ms | p99 ms | partial | errors | q/s / serve "
        "| CPU ms/request by process | servers' CPU ms/request | CPU used by others |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["inprocess"]:
        lines.append(
            f"| in-process forward | 1 | {r['filter']} | {1e3 / r['p50_ms']:.0f} (1/p50) | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | — | — | — | — | — | {r['other_load']:.0%} |"
        )
        lines.append(
            f"| in-process forward | batch {r['batch']} | {r['filter']} | {r['batched_qps']:.0f}"
            " | — | — | — | — | — | — | — | — |"
        )
    for r in results.get("load", []):
        cpu = r["cpu_ms_per_request"]
        name = config_name(r["shards"], r["embedding_servers"])
        if "pair" in r:
            name += f" (turns with {r['pair']})"
        lines.append(
            f"| {name} | {r['concurrency']} | "
            f"{r['filter']} | {r['qps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['partial']} | {sum(r['errors'].values())} | {cell(r.get('qps_vs_serve'), '.2f')}"
            f" | {_cpu_cell(cpu)} | {cell(cpu.get('servers'), '.2f')} | {r['other_load']:.0%} |"
        )
    return lines


def render_checks(results: dict[str, Any]) -> str:
    """One line: per configuration, whether every checked answer equals the in-process forward."""
    by: dict[str, bool] = {}
    for c in results.get("checks", []):
        name = config_name(c["shards"], c["embedding_servers"])
        by[name] = by.get(name, True) and c["equal"]
    users = max((c["users"] for c in results.get("checks", [])), default=0)
    parts = ", ".join(f"{name} equal: {str(ok).lower()}" for name, ok in by.items())
    return (
        f"Answers == in-process forward ({users} users x every filter; ids equal but the order "
        f"of tied items, scores within {SCORE_ATOL:g}): {parts or 'not checked'}"
    )


def render_remote(results: dict[str, Any]) -> list[str]:
    """Which tables the embedding-server cases put on the embedding server."""
    return [
        f"\n{r['shards']} shards + 1 embedding server: remote tables {', '.join(r['tables'])}"
        for r in results.get("remote_tables", [])
    ]


def render_breakdown(results: dict[str, Any]) -> list[str]:
    """p50 ms of one request, from the in-process forward to serve and the cluster, per S and
    filter (the cluster without embedding servers)."""
    base = {r["filter"]: r["p50_ms"] for r in results["inprocess"]}
    delays = sorted({r["queue_delay_ms"] for r in results.get("inprocess_router", [])})

    def p50(kind: str, s: int, label: str, **match: Any) -> float | None:
        for r in results.get(kind, []):
            if (
                r["shards"] == s
                and r["filter"] == label
                and all(r.get(k) == v for k, v in match.items())
            ):
                return r["p50_ms"]
        return None

    lines = [
        "| S | filter | in-process forward | serve, 1 client | local merge (no gRPC) | "
        + "".join(f"in-process router, queue delay {d:g} ms | " for d in delays)
        + "cluster, 1 client | cluster − serve | cluster − in-process |",
        "|---|---|---|---|---|" + "---|" * len(delays) + "---|---|---|",
    ]
    for s in results["config"]["shards"]:
        for label, b in base.items():
            c = p50("load", s, label, concurrency=1, embedding_servers=0)
            pair = config_name(s, 0) if _paired(results.get("load", [])) else None
            sv = p50("load", 0, label, concurrency=1, pair=pair)
            lines.append(
                f"| {s} | {label} | {b:.2f} | {cell(sv, '.2f')} | "
                f"{cell(p50('local_merge', s, label), '.2f')} | "
                + "".join(
                    f"{cell(p50('inprocess_router', s, label, queue_delay_ms=d), '.2f')} | "
                    for d in delays
                )
                + f"{cell(c, '.2f')} | "
                f"{cell(None if c is None or sv is None else c - sv, '+.2f')} | "
                f"{cell(None if c is None else c - b, '+.2f')} |"
            )
    return lines
