"""Render ``bench/RESULTS.md``, the current page, from ``bench/results/*.json``.

``bench/page.toml`` names, per target, the JSON files that hold its latest figures and how to
read them (``kind``); this script reads each file and writes one table per target: the latest
figure, its ratio to the fastest peer that reaches the same recall (named), the command (from the
JSON's own argv), the date and the commit that recorded the JSON. Figures older than the JSON
files are ``[[target.hand]]`` rows of the manifest, copied from ``bench/journal/`` and marked so.

    .venv/bin/python bench/render_results.py           # write bench/RESULTS.md
    .venv/bin/python bench/render_results.py --check   # exit 1 when RESULTS.md is not the render
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
MANIFEST = BENCH / "page.toml"
PAGE = BENCH / "RESULTS.md"
Spec = dict[str, Any]
Rows = list[list[str]]


def ratio(x: float | None) -> str:
    """A ratio as the page writes it: two decimals below 10, one below 100, else none."""
    if x is None:
        return "—"
    return f"{x:.2f}×" if x < 10 else f"{x:.1f}×" if x < 100 else f"{x:.0f}×"


def qps(x: float) -> str:
    """A rate: thousands as ``k`` from 10,000 up."""
    return f"{x / 1000:.1f}k" if x >= 10_000 else f"{x:,.0f}"


def ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}"


def load(spec: Spec) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((BENCH / "results" / spec["json"]).read_text())
    return data


def ann_points(data: dict[str, Any], spec: Spec, filt: str, target: float) -> tuple[Any, Any]:
    """(ours, peers): our named system's points and every other system's best point per system,
    at ``filt``, that reach ``target`` recall (each system at its fastest such setting)."""
    ours_name = spec.get("ours", "ours-int8")
    reach = [p for p in data["points"] if p["filter"] == filt and p["recall"] >= target]
    ours = max(
        (p for p in reach if p["system"] == ours_name), key=lambda p: p["qps_batch"], default=None
    )
    best: dict[str, Any] = {}
    for p in reach:
        if (
            not p["system"].startswith("ours")
            and p["qps_batch"] > best.get(p["system"], {"qps_batch": 0})["qps_batch"]
        ):
            best[p["system"]] = p
    return ours, list(best.values())


def turns(data: dict[str, Any], spec: Spec, filt: str, target: float, peer: str) -> Any:
    """The ``--rounds`` entry for ours against ``peer``, or None when the run had none."""
    ours_name = spec.get("ours", "ours-int8")
    for r in data.get("rounds", []):
        if (r["ours"], r["filter"], r["target"], r["peer"]) == (ours_name, filt, target, peer):
            return r
    return None


def ann(data: dict[str, Any], spec: Spec) -> Rows:
    """Batched q/s and one query's p50, ours against the fastest peer reaching the same recall;
    a ratio from ``--rounds`` (median of turns) where the run has one for that peer."""
    rows: Rows = []
    for filt in spec.get("filters", ["none"]):
        for target in spec.get("recalls", [0.95]):
            ours, peers = ann_points(data, spec, filt, target)
            case = [spec["case"], "none" if filt == "none" else filt, f"{target:.2f}"]
            if ours is None or not peers:
                missing = "ours" if ours is None else "no peer"
                rows.append([*case, f"{missing} does not reach it", "—", "—", "—", "—"])
                continue
            peer = max(peers, key=lambda p: p["qps_batch"])
            fast = min(peers, key=lambda p: p["p50_single_ms"])
            r, r1 = (
                turns(data, spec, filt, target, peer["system"]),
                turns(data, spec, filt, target, fast["system"]),
            )
            batched = r["qps_ratio_median"] if r else ours["qps_batch"] / peer["qps_batch"]
            single = r1["p50_ratio_median"] if r1 else fast["p50_single_ms"] / ours["p50_single_ms"]
            how = f", median of {len(r['qps_ratios'])} turns" if r else ", one sweep"
            rows.append(
                [
                    *case,
                    f"{ours['setting']}, {ours['recall']:.3f}, {qps(ours['qps_batch'])}",
                    f"{peer['system']} {peer['setting']}, {peer['recall']:.3f}, {qps(peer['qps_batch'])}",
                    f"**{ratio(batched)}**{how}",
                    f"{ms(ours['p50_single_ms'])} / {ms(fast['p50_single_ms'])} ({fast['system']})",
                    ratio(single),
                ]
            )
    return rows


def ann_build(data: dict[str, Any], spec: Spec) -> Rows:
    """Our build against faiss's k-means plus its faster add (IVF-Flat or IVF-SQ8)."""
    b = data["builds"]
    peer = min(("faiss-IVF-Flat", "faiss-IVF-SQ8"), key=lambda s: b[s])
    faiss_s = b["faiss-kmeans"] + b[peer]
    rounds = data.get("build_rounds")
    turned = "—"
    if rounds:
        each = [o / p for o, p in zip(rounds["ours_s"], rounds["peer_s"], strict=True)]
        turned = f"**{statistics.median(each):.2f}** ({len(each)} turns vs IVF-SQ8)"
    return [
        [
            spec["case"],
            f"{b['ours-int8']:.2f} s",
            f"k-means + {peer}: {faiss_s:.2f} s",
            f"**{b['ours-int8'] / faiss_s:.2f}**",
            turned,
        ]
    ]


def ann_bytes(data: dict[str, Any], spec: Spec) -> Rows:
    """Bytes per item: ours against the smallest peer index that reaches 0.95 recall."""
    ours, peers = ann_points(data, spec, spec.get("filter", "none"), 0.95)
    peers = [p for p in peers if p["system"].startswith("faiss-IVF")]
    small = min(peers, key=lambda p: p["bytes_per_item"])
    over = ours["bytes_per_item"] / small["bytes_per_item"] - 1
    return [
        [
            spec["case"],
            f"{ours['bytes_per_item']:.1f}",
            f"{small['system']}: {small['bytes_per_item']:.1f}",
            f"**{over:+.1%}**",
        ]
    ]


def index_bytes(data: dict[str, Any], spec: Spec) -> Rows:
    """``bench/index_bytes.py``: bytes per item at the default (no filter attributes) vs SQ8."""
    return [
        [
            f"{r['n']:,} × {r['d']}, IVF{r['nlist']}",
            f"{r['ours_bytes_per_item']:.1f}",
            f"faiss-IVF-SQ8: {r['sq8_bytes_per_item']:.1f}",
            f"**{r['ratio'] - 1:+.1%}**",
        ]
        for r in data["rows"]
    ]


def best(b: dict[str, Any] | None) -> str:
    """A load row's q/s and clients, or why there is none."""
    return f"{b['qps']:,.0f} (C = {b['concurrency']})" if b else "none under the line"


def serving(data: dict[str, Any], spec: Spec) -> Rows:
    """Max q/s at p99 <= 20 ms, ours against each peer of the same run."""
    s, ours = data["summary"], spec.get("ours", "ours")
    rows = []
    for peer in spec["peers"]:
        r = s["best"][ours]["qps"] / s["best"][peer]["qps"]
        rows.append(
            [
                spec["case"],
                f"{ours}: {best(s['best'][ours])}",
                f"{peer}: {best(s['best'][peer])}",
                f"**{ratio(r)}**",
                f"≥ {spec['targets'][peer]}×",
            ]
        )
    return rows


def serving_points(data: dict[str, Any], spec: Spec) -> Rows:
    """q/s at each concurrency of one system of this JSON against one of another JSON."""
    other = load({"json": spec["peer_json"]})
    theirs = {r["concurrency"]: r for r in other["systems"][spec["peer"]]["rows"]}
    rows = []
    for r in data["systems"][spec["ours"]]["rows"]:
        p = theirs[r["concurrency"]]
        rows.append(
            [
                spec["case"],
                str(r["concurrency"]),
                f"{r['qps']:,.0f}, p50 {ms(r['p50_ms'])} ms",
                f"{spec['peer_label']}: {p['qps']:,.0f}, p50 {ms(p['p50_ms'])} ms",
                f"**{ratio(r['qps'] / p['qps'])}**",
            ]
        )
    return rows


def sharding(data: dict[str, Any], spec: Spec) -> Rows:
    """Each routed configuration against `recserve serve` in the same turns."""
    rows = []
    for s in data["summary"]:
        p50 = s["p50_minus_serve_ms"]
        p50_target = "" if s["p50_target_ms"] is None else f" (target ≤ +{s['p50_target_ms']:g})"
        rows.append(
            [
                s["config"],
                s["filter"],
                best(s.get("best")),
                best(s["serve_best"]),
                f"**{ratio(s['qps_vs_serve'])}** (target ≥ {s['qps_target']}×)",
                f"{p50:+.2f} ms{p50_target}",
                f"{s['servers_cpu_ms']:.2f} ms",
            ]
        )
    return rows


def remote_hot(data: dict[str, Any], spec: Spec) -> Rows:
    """Recommend p50 with the item table read through its cache, over all tables local."""
    return [
        [
            r["filter"],
            str(r["concurrency"]),
            f"**{r['p50']:.2f}×** (median of {len(r['p50_each'])} rounds)",
            f"{r['qps']:.2f}×",
            "≤ 1.5×",
        ]
        for r in data["ratios"]
    ]


def gpu(data: dict[str, Any], spec: Spec) -> Rows:
    """The index on the GPU against exact search (one float16 GEMM + topk) on the same GPU."""
    rows = []
    for size in data["sizes"]:
        if size["n"] not in spec.get("sizes", [size["n"]]):
            continue
        for r in size["rows"]:
            if r["k"] != 100 or r["batch"] not in spec.get("batches", [1, 1024]):
                continue
            recall = (
                f"{r['ours']['recall']:.3f} / {r['brute']['recall']:.3f}"
                if "recall" in r["ours"]
                else ""
            )
            rows.append(
                [
                    f"{size['n']:,}",
                    f"{r['selectivity']:.1%}",
                    str(r["batch"]),
                    f"{qps(r['ours']['qps'])}, p50 {ms(r['ours']['p50_ms'])} ms",
                    f"{qps(r['brute']['qps'])}, p50 {ms(r['brute']['p50_ms'])} ms",
                    f"**{ratio(r['speedup'])}**",
                    recall,
                ]
            )
    return rows


def tables(data: dict[str, Any], spec: Spec) -> Rows:
    """Our host tier's lookups/s against the faster of nn.EmbeddingBag FP32 and raw fbgemm."""
    rows = []
    for dist in ("uniform", "zipf"):
        cases = [c for c in data["cases"] if c["dist"] == dist]
        for dtype in spec["dtypes"]:
            ours = next(c for c in cases if c["system"] == spec["ours"] and c["dtype"] == dtype)
            peers = [
                c
                for c in cases
                if c["system"] == "nn.EmbeddingBag"
                or (c["system"] == "fbgemm TBE (raw)" and c["dtype"] == dtype)
            ]
            peer = max(peers, key=lambda c: c["lookups_per_s"])
            rows.append(
                [
                    dist,
                    dtype,
                    f"{ours['lookups_per_s'] / 1e6:.1f} M/s",
                    f"{peer['system']} {peer['dtype']}: {peer['lookups_per_s'] / 1e6:.1f} M/s",
                    f"**{ratio(ours['lookups_per_s'] / peer['lookups_per_s'])}**",
                ]
            )
    return rows


def quality(data: dict[str, Any], spec: Spec) -> Rows:
    """recall@100 (every consumed item excluded) of each of our models against the best baseline."""
    rows = []
    wanted = spec.get("datasets")
    for res in data["results"]:
        if wanted and not any(res["dataset"].startswith(w) for w in wanted):
            continue
        base = {name: b["full"]["recall"] for name, b in res["baselines"].items()}
        peer = max(base, key=lambda n: base[n])
        for opt, m in res["models"].items():
            r = m["rows"][spec["row"]]
            rows.append(
                [
                    res["dataset"],
                    f"{opt}, {spec['row']}",
                    f"{r['recall']:.4f} ± {r['recall_std']:.4f}",
                    f"{peer}: {base[peer]:.4f}",
                    f"**{ratio(r['recall'] / base[peer])}**",
                ]
            )
    return rows


def train(data: dict[str, Any], spec: Spec) -> Rows:
    """Our training loop's pairs/s against the fastest TorchRec loop of the same run."""
    rows = []
    for res in data["results"]:
        loops = {r["loop"]: r["ex_per_s_median"] for r in res["rows"]}
        peer = max((n for n in loops if n.startswith("TorchRec")), key=lambda n: loops[n])
        rows.append(
            [
                res["dataset"],
                spec["ours"],
                f"{loops[spec['ours']]:,.0f}",
                f"{peer}: {loops[peer]:,.0f}",
                f"**{ratio(loops[spec['ours']] / loops[peer])}**",
            ]
        )
    return rows


def filtered(data: dict[str, Any], spec: Spec) -> Rows:
    """``bench/filtered.py``: our default plan against faiss IVF-SQ8 + bitmap at its cheapest
    nprobe reaching 0.95 (the run's only peer)."""
    rows = []
    for r in data["results"]:
        ours = r["ours"]["new"]
        peer = max((f for f in r["faiss"] if f["recall"] >= 0.95), key=lambda f: f["qps"])
        rows.append(
            [
                spec["case"],
                r["label"],
                f"{ours['recall']:.3f}, {qps(ours['qps'])}",
                f"faiss-IVF-SQ8 + bitmap nprobe={peer['nprobe']}, {peer['recall']:.3f}, {qps(peer['qps'])}",
                f"**{ratio(ours['qps'] / peer['qps'])}**",
            ]
        )
    return rows


def train_dmp(data: dict[str, Any], spec: Spec) -> Rows:
    """``bench/train_dmp.py``: each case against our fused single-process trainer."""
    return [
        [
            f"{data['users']:,} users × {data['items']:,} items",
            r["case"],
            f"{r['ex_per_s_median']:,.0f}",
            "ours fused, 1 process",
            f"**{ratio(r['vs_ours_fused'])}**",
        ]
        for r in data["rounds"]
        if not r["case"].startswith("ours")
    ]


KINDS: dict[str, tuple[Callable[[dict[str, Any], Spec], Rows], list[str]]] = {
    "ann": (
        ann,
        [
            "data, path",
            "filter",
            "recall ≥",
            "ours: setting, recall, q/s",
            "fastest peer at that recall",
            "batched, ours ÷ peer",
            "one query p50 ms: ours / fastest peer",
            "one query, ours ÷ peer",
        ],
    ),
    "ann_build": (
        ann_build,
        ["data", "ours", "fastest faiss build", "ours ÷ faiss (≤ 1 meets)", "in turns"],
    ),
    "ann_bytes": (
        ann_bytes,
        ["data", "ours, bytes/item", "smallest faiss IVF at recall ≥ 0.95", "ours over it"],
    ),
    "index_bytes": (
        index_bytes,
        ["data", "ours, bytes/item", "smallest faiss IVF at recall ≥ 0.95", "ours over it"],
    ),
    "serving": (serving, ["run", "ours: max q/s at p99 ≤ 20 ms", "peer", "ours ÷ peer", "target"]),
    "serving_points": (serving_points, ["case", "clients", "ours", "peer", "ours ÷ peer"]),
    "sharding": (
        sharding,
        [
            "configuration",
            "filter",
            "routed: max q/s at p99 ≤ 20 ms",
            "serve, same turns",
            "routed ÷ serve",
            "p50 at 1 client − serve's",
            "servers' CPU a request",
        ],
    ),
    "remote_hot": (
        remote_hot,
        ["filter", "clients", "p50 ÷ all tables local", "q/s ÷ local", "target"],
    ),
    "gpu": (
        gpu,
        [
            "items",
            "filter passes",
            "batch",
            "ours",
            "GEMM + topk (exact, same GPU)",
            "ours ÷ exact",
            "recall ours / exact",
        ],
    ),
    "tables": (tables, ["ids", "dtype", "ours", "fastest peer", "ours ÷ peer"]),
    "quality": (quality, ["data", "ours", "recall@100", "best baseline", "ours ÷ baseline"]),
    "filtered": (
        filtered,
        ["data", "filter", "ours: recall, q/s", "fastest peer at recall ≥ 0.95", "ours ÷ peer"],
    ),
    "train_dmp": (train_dmp, ["data", "case", "examples/s", "against", "case ÷ ours"]),
    "train": (train, ["data", "ours", "pairs/s", "fastest TorchRec loop", "ours ÷ peer"]),
}


def command(spec: Spec, data: dict[str, Any]) -> str:
    """The command that wrote the JSON: the manifest's, or the bench script with the JSON's argv."""
    if "command" in spec:
        return str(spec["command"])
    meta = data.get("meta") or data.get("environment") or {}
    argv = meta.get("argv") or data.get("argv") or []
    env = f"env {spec['env']} " if "env" in spec else ""
    return f"{env}.venv/bin/python bench/{spec['script']} {shlex.join(argv)}".rstrip()


def machine(data: dict[str, Any]) -> str:
    """The CPU and our scan's instruction set where the JSON recorded them."""
    meta, builds = data.get("meta") or {}, data.get("builds") or {}
    said = [str(meta["cpu"])] if meta.get("cpu") else []
    said += [f"our scan: {builds['ours-int8-isa']}"] if builds.get("ours-int8-isa") else []
    return f" ({', '.join(said)})" if said else ""


def date_of(spec: Spec, data: dict[str, Any]) -> str:
    meta = data.get("meta") or data.get("environment") or {}
    return str(spec.get("date") or meta.get("date", "")[:10])


def table(head: list[str], rows: Rows) -> list[str]:
    """A markdown table and the blank line after it."""
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return [*out, *("| " + " | ".join(r) + " |" for r in rows), ""]


def section(target: Spec) -> list[str]:
    """One target: its rendered table, its commands, and its hand-kept rows."""
    out = [f"## {target['title']}", ""]
    if "note" in target:
        out += [target["note"].strip(), ""]
    commands: list[tuple[str, str, str]] = []
    if target.get("row"):
        head = KINDS[target["row"][0]["kind"]][1]
        rows: Rows = []
        for spec in target["row"]:
            fn, _ = KINDS[spec["kind"]]
            data = load(spec)
            cmd = (command(spec, data), spec["json"], machine(data))
            if cmd not in commands:
                commands.append(cmd)
            ref = f"[{commands.index(cmd) + 1}]"
            rows += [[*r, date_of(spec, data), f"`{spec['commit']}`", ref] for r in fn(data, spec)]
        out += table([*head, "date", "commit", "cmd"], rows)
        out += [f"{i}. `{c}` → `bench/results/{j}`{m}" for i, (c, j, m) in enumerate(commands, 1)]
        out.append("")
    if target.get("hand"):
        out += [
            "Hand-kept (no JSON for these figures; copied from the journal, with its date and commit):",
            "",
        ]
        out += table(
            ["figure", "latest", "against", "date", "commit", "journal section"],
            [
                [h["figure"], h["latest"], h["against"], h["date"], f"`{h['commit']}`", h["source"]]
                for h in target["hand"]
            ],
        )
    return out


def render(manifest: Spec) -> str:
    lines = [manifest["title"], "", manifest["intro"].strip(), ""]
    for target in manifest["target"]:
        lines += section(target)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="fail when RESULTS.md differs from the render"
    )
    ap.add_argument("--manifest", type=Path, default=MANIFEST, help="the page's manifest (TOML)")
    ap.add_argument("--out", type=Path, default=PAGE, help="the page to write or check")
    args = ap.parse_args(argv)
    text = render(tomllib.loads(args.manifest.read_text()))
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(
                f"{args.out} is not what {args.manifest.name} renders: run bench/render_results.py",
                file=sys.stderr,
            )
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
