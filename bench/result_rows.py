"""How each kind of ``bench/results/*.json`` becomes rows of its table on ``bench/RESULTS.md``:
one function per ``kind`` of ``bench/page.toml`` (:data:`KINDS`, with the table's header), and the
number formats they share. ``render_results.py`` assembles the page around them."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
Spec = dict[str, Any]
Data = dict[str, Any]
Rows = list[str]  # one table row each, its cells joined by " | "


def ratio(x: float) -> str:
    """A ratio as the page writes it: two decimals below 10, one below 100, else none."""
    return f"{x:.2f}×" if x < 10 else f"{x:.1f}×" if x < 100 else f"{x:.0f}×"


def bold(x: float) -> str:
    return f"**{ratio(x)}**"


def qps(x: float) -> str:
    """A rate: thousands as ``k`` from 10,000 up."""
    return f"{x / 1000:.1f}k" if x >= 10_000 else f"{x:,.0f}"


def ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}"


def load(name: str) -> Data:
    data: Data = json.loads((BENCH / "results" / name).read_text())
    return data


def ann_points(data: Data, spec: Spec, filt: str, target: float) -> tuple[Any, list[Any]]:
    """(ours, peers) at ``filt`` among the points reaching ``target`` recall: our named system's
    fastest point, and each other system's fastest point."""
    name = spec.get("ours", "ours-int8")
    reach = [p for p in data["points"] if p["filter"] == filt and p["recall"] >= target]
    ours = max(
        (p for p in reach if p["system"] == name), key=lambda p: p["qps_batch"], default=None
    )
    best: dict[str, Any] = {}
    for p in (p for p in reach if not p["system"].startswith("ours")):
        if p["qps_batch"] > best.get(p["system"], {"qps_batch": 0})["qps_batch"]:
            best[p["system"]] = p
    return ours, list(best.values())


def turns(data: Data, spec: Spec, filt: str, target: float, peer: str) -> Any:
    """The ``--rounds`` entry for ours against ``peer``, or None when the run had none."""
    key = (spec.get("ours", "ours-int8"), filt, target, peer)
    rounds = data.get("rounds", [])
    return next(
        (r for r in rounds if (r["ours"], r["filter"], r["target"], r["peer"]) == key), None
    )


def ann(data: Data, spec: Spec) -> Rows:
    """Batched q/s and one query's p50, ours against the fastest peer reaching the same recall;
    the ratio from ``--rounds`` (the median of turns) where the run has one for that peer."""
    rows = []
    for filt in spec.get("filters", ["none"]):
        for target in spec.get("recalls", [0.95]):
            ours, peers = ann_points(data, spec, filt, target)
            case = f"{spec['case']} | {filt} | {target:.2f}"
            if ours is None or not peers:
                top = max(
                    (
                        p["recall"]
                        for p in data["points"]
                        if p["system"] == spec.get("ours", "ours-int8") and p["filter"] == filt
                    ),
                    default=0.0,
                )
                why = (
                    f"ours: not in the sweep (its best {top:.3f})"
                    if ours is None
                    else "no peer reaches it"
                )
                rows.append(f"{case} | {why} | — | — | — | —")
                continue
            peer = max(peers, key=lambda p: p["qps_batch"])
            fast = min(peers, key=lambda p: p["p50_single_ms"])
            r, r1 = (turns(data, spec, filt, target, p["system"]) for p in (peer, fast))
            batched = r["qps_ratio_median"] if r else ours["qps_batch"] / peer["qps_batch"]
            single = r1["p50_ratio_median"] if r1 else fast["p50_single_ms"] / ours["p50_single_ms"]
            how = f"median of {len(r['qps_ratios'])} turns" if r else "one sweep"
            rows.append(
                f"{case} | {ours['setting']}, {ours['recall']:.3f}, {qps(ours['qps_batch'])} | "
                f"{peer['system']} {peer['setting']}, {peer['recall']:.3f}, {qps(peer['qps_batch'])} | "
                f"{bold(batched)}, {how} | {ms(ours['p50_single_ms'])} / {ms(fast['p50_single_ms'])} "
                f"({fast['system']}) | {ratio(single)}"
            )
    return rows


def ann_build(data: Data, spec: Spec) -> Rows:
    """Our build against faiss's k-means plus its faster add (IVF-Flat or IVF-SQ8)."""
    b, rounds = data["builds"], data.get("build_rounds")
    peer = min(("faiss-IVF-Flat", "faiss-IVF-SQ8"), key=lambda s: b[s])
    faiss_s = b["faiss-kmeans"] + b[peer]
    turned = "—"
    if rounds:
        each = [o / p for o, p in zip(rounds["ours_s"], rounds["peer_s"], strict=True)]
        turned = f"**{statistics.median(each):.2f}** ({len(each)} turns vs IVF-SQ8)"
    ours = b["ours-int8"]
    return [
        f"{spec['case']} | {ours:.2f} s | k-means + {peer}: {faiss_s:.2f} s | **{ours / faiss_s:.2f}** | {turned}"
    ]


def ann_bytes(data: Data, spec: Spec) -> Rows:
    """Bytes per item: ours against the smallest faiss IVF index that reaches 0.95 recall."""
    ours, peers = ann_points(data, spec, "none", 0.95)
    small = min(
        (p for p in peers if p["system"].startswith("faiss-IVF")), key=lambda p: p["bytes_per_item"]
    )
    over = ours["bytes_per_item"] / small["bytes_per_item"] - 1
    return [
        f"{spec['case']} | {ours['bytes_per_item']:.1f} | {small['system']}: {small['bytes_per_item']:.1f} | **{over:+.1%}**"
    ]


def index_bytes(data: Data, spec: Spec) -> Rows:
    """``bench/index_bytes.py``: bytes per item of the default index (no filter attributes)."""
    return [
        f"{r['n']:,} × {r['d']}, IVF{r['nlist']} | {r['ours_bytes_per_item']:.1f} | "
        f"faiss-IVF-SQ8: {r['sq8_bytes_per_item']:.1f} | **{r['ratio'] - 1:+.1%}**"
        for r in data["rows"]
    ]


def best(b: Data | None) -> str:
    """A load row's q/s and clients, or why there is none."""
    return f"{b['qps']:,.0f} (C = {b['concurrency']})" if b else "none under the line"


def serving(data: Data, spec: Spec) -> Rows:
    """Max q/s at p99 <= 20 ms, ours against each peer of the same run."""
    top = data["summary"]["best"]
    ours = top[spec.get("ours", "ours")]
    return [
        f"{spec['case']} | {best(ours)} | {p}: {best(top[p])} | {bold(ours['qps'] / top[p]['qps'])} | ≥ {spec['targets'][p]}×"
        for p in spec["peers"]
    ]


def serving_points(data: Data, spec: Spec) -> Rows:
    """q/s at each concurrency of one system of this JSON against one of another JSON."""
    theirs = {r["concurrency"]: r for r in load(spec["peer_json"])["systems"][spec["peer"]]["rows"]}
    rows = []
    for r in data["systems"][spec["ours"]]["rows"]:
        p = theirs[r["concurrency"]]
        rows.append(
            f"{spec['case']} | {r['concurrency']} | {r['qps']:,.0f}, p50 {ms(r['p50_ms'])} ms | "
            f"{spec['peer_label']}: {p['qps']:,.0f}, p50 {ms(p['p50_ms'])} ms | {bold(r['qps'] / p['qps'])}"
        )
    return rows


def sharding(data: Data, spec: Spec) -> Rows:
    """Each routed configuration against `recserve serve` in the same turns."""
    rows = []
    for s in data["summary"]:
        p50 = f"{s['p50_minus_serve_ms']:+.2f} ms"
        p50 += "" if s["p50_target_ms"] is None else f" (target ≤ +{s['p50_target_ms']:g})"
        rows.append(
            f"{s['config']} | {s['filter']} | {best(s.get('best'))} | {best(s['serve_best'])} | "
            f"{bold(s['qps_vs_serve'])} (target ≥ {s['qps_target']}×) | {p50} | {s['servers_cpu_ms']:.2f} ms"
        )
    return rows


def netns(data: Data, spec: Spec) -> Rows:
    """Routed (router + 1 shard) against `recserve serve`, each on namespaced hosts."""
    v, best_qps, p50 = data["verdict"], data["max_qps"], data["p50_1_ms"]
    ratio_txt = "—" if v["max_qps_ratio"] is None else bold(v["max_qps_ratio"])
    errors = sum(n for r in data["rows"]["routed"] for n in r["errors"].values())
    calls = sum(r["requests"] for r in data["rows"]["routed"])
    argv = data["meta"]["argv"]
    flag = "--shard-deadline-ms"
    deadline = float(argv[argv.index(flag) + 1]) if flag in argv else 200.0
    label = f"{data['network']}, shard deadline {deadline:g} ms"
    if data.get("replicas", 1) > 1:
        hedge = data.get("hedge_after_ms", 0.0)
        label += f", {data['replicas']} replicas, hedge {f'{hedge:g} ms' if hedge else 'adaptive'}"
    return [
        f"{label} | {qps(best_qps['routed'])} | "
        f"{qps(best_qps['serve'])} | {ratio_txt} | {p50['routed']:.2f} / {p50['serve']:.2f} ms "
        f"({v['p50_1_delta_ms']:+.2f} ms) | {errors} of {calls:,}"
    ]


def netns_tier(data: Data, spec: Spec) -> Rows:
    """Recommend with the coldest tables on an embedding host against all tables local."""
    v, best_qps, p50 = data["verdict"], data["max_qps"], data["p50_1_ms"]
    ratio_txt = "—" if v["max_qps_ratio"] is None else ratio(v["max_qps_ratio"])
    refused = {s: sum(n for r in data["rows"][s] for n in r["errors"].values()) for s in p50}
    calls = {s: sum(r["requests"] for r in data["rows"][s]) for s in p50}
    return [
        f"{data['network']}, shard deadline {data['shard_deadline_ms']:g} ms | "
        f"{p50['remote']:.2f} / {p50['local']:.2f} ms "
        f"({v['p50_1_delta_ms']:+.2f} ms) | {bold(v['p50_1_ratio'])} | "
        f"{qps(best_qps['remote'])} / {qps(best_qps['local'])} | {ratio_txt} | "
        f"{refused['remote']} of {calls['remote']:,} / {refused['local']} of {calls['local']:,}"
    ]


def relay_cost(data: Data, spec: Spec) -> Rows:
    """``bench/relay_cost.py``: echo round trips through the relay against direct ones."""
    rows = data["rows"]
    out = []
    for r in rows:
        if r["case"] == "direct":
            continue
        direct = next(
            d for d in rows if d["case"] == "direct" and d["concurrency"] == r["concurrency"]
        )
        out.append(
            f"{r['case']} | {r['concurrency']} | {qps(r['round_trips_per_s'])}, p50 {ms(r['p50_ms'])} ms"
            f" | {qps(direct['round_trips_per_s'])}, p50 {ms(direct['p50_ms'])} ms | "
            f"{r['profile_rtt_ms']:g} ms | **{r['added_p50_ms'] * 1e3:+.0f} µs** | "
            f"{r['relay_cpu_ms'] * 1e3:.0f} µs"
        )
    return out


def remote_hot(data: Data, spec: Spec) -> Rows:
    """Recommend p50 with the item table read through its cache, over all tables local."""
    return [
        f"{r['filter']} | {r['concurrency']} | **{r['p50']:.2f}×** (median of {len(r['p50_each'])} rounds) | {r['qps']:.2f}× | ≤ 1.5×"
        for r in data["ratios"]
    ]


def gpu(data: Data, spec: Spec) -> Rows:
    """The index on the GPU against exact search (one float16 GEMM + topk) on the same GPU."""
    rows = []
    for size in (s for s in data["sizes"] if s["n"] in spec.get("sizes", [s["n"]])):
        for r in size["rows"]:
            if r["k"] != 100 or r["batch"] not in spec.get("batches", [1, 1024]):
                continue
            o, e = r["ours"], r["brute"]
            recall = f"{o['recall']:.3f} / {e['recall']:.3f}" if "recall" in o else ""
            rows.append(
                f"{size['n']:,} | {r['selectivity']:.1%} | {r['batch']} | {qps(o['qps'])}, p50 {ms(o['p50_ms'])} ms | "
                f"{qps(e['qps'])}, p50 {ms(e['p50_ms'])} ms | {bold(r['speedup'])} | {recall}"
            )
    return rows


def tables(data: Data, spec: Spec) -> Rows:
    """Our tier's lookups/s against the faster of nn.EmbeddingBag FP32 and raw fbgemm."""
    rows = []
    for dist in ("uniform", "zipf"):
        cases = [c for c in data["cases"] if c["dist"] == dist]
        for dtype in spec["dtypes"]:
            ours = next(c for c in cases if c["system"] == spec["ours"] and c["dtype"] == dtype)
            peer = max(
                (
                    c
                    for c in cases
                    if c["system"] == "nn.EmbeddingBag"
                    or (c["system"] == "fbgemm TBE (raw)" and c["dtype"] == dtype)
                ),
                key=lambda c: c["lookups_per_s"],
            )
            rows.append(
                f"{dist} | {dtype} | {ours['lookups_per_s'] / 1e6:.1f} M/s | {peer['system']} {peer['dtype']}: "
                f"{peer['lookups_per_s'] / 1e6:.1f} M/s | {bold(ours['lookups_per_s'] / peer['lookups_per_s'])}"
            )
    return rows


def quality(data: Data, spec: Spec) -> Rows:
    """recall@100 (every consumed item excluded) of our models against the best baseline."""
    rows, wanted = [], spec.get("datasets")
    for res in data["results"]:
        if wanted and not any(res["dataset"].startswith(w) for w in wanted):
            continue
        base = {name: b["full"]["recall"] for name, b in res["baselines"].items()}
        peer = max(base, key=lambda n: base[n])
        rows += [
            f"{res['dataset']} | baseline: {n} | {base[n]:.4f} | — | —"
            for n in sorted(base, key=lambda n: base[n])
        ]
        for opt, m in res["models"].items():
            for name in spec["rows"]:
                r = m["rows"][name]
                rows.append(
                    f"{res['dataset']} | {opt}, {name} | {r['recall']:.4f} ± {r['recall_std']:.4f} | "
                    f"{peer}: {base[peer]:.4f} | {bold(r['recall'] / base[peer])}"
                )
    return rows


def hashed(data: Data, spec: Spec) -> Rows:
    """``bench/hashed.py``: each case's quality and speed against every user's row resident."""
    full = next(r for r in data["runs"] if r["case"] == "all resident")
    return [
        f"{r['case']} | {r['working_rows']:,} | {r['recall@100']:.4f} | {r['examples_per_s']:,.0f} | "
        f"**{r['recall@100'] - full['recall@100']:+.4f}** | {ratio(r['examples_per_s'] / full['examples_per_s'])}"
        for r in data["runs"]
    ]


def train(data: Data, spec: Spec) -> Rows:
    """Our training loop's pairs/s against the fastest TorchRec loop of the same run."""
    rows = []
    for res in data["results"]:
        loops = {r["loop"]: r["ex_per_s_median"] for r in res["rows"]}
        peer = max((n for n in loops if n.startswith("TorchRec")), key=lambda n: loops[n])
        ours = loops[spec["ours"]]
        rows.append(
            f"{res['dataset']} | {spec['ours']} | {ours:,.0f} | {peer}: {loops[peer]:,.0f} | {bold(ours / loops[peer])}"
        )
    return rows


def train_dmp(data: Data, spec: Spec) -> Rows:
    """``bench/train_dmp.py``: each DMP case against our fused single-process trainer."""
    return [
        f"{data['users']:,} users × {data['items']:,} items | {r['case']} | {r['ex_per_s_median']:,.0f} | "
        f"ours fused, 1 process | {bold(r['vs_ours_fused'])}"
        for r in data["rounds"]
        if not r["case"].startswith("ours")
    ]


def filtered(data: Data, spec: Spec) -> Rows:
    """``bench/filtered.py``: our default plan against faiss IVF-SQ8 + bitmap at its cheapest
    nprobe reaching 0.95 (the run's only peer)."""
    rows = []
    for r in data["results"]:
        ours = r["ours"]["new"]
        peer = max((f for f in r["faiss"] if f["recall"] >= 0.95), key=lambda f: f["qps"])
        rows.append(
            f"{spec['case']} | {r['label']} | {ours['recall']:.3f}, {qps(ours['qps'])} | faiss-IVF-SQ8 + bitmap "
            f"nprobe={peer['nprobe']}, {peer['recall']:.3f}, {qps(peer['qps'])} | {bold(ours['qps'] / peer['qps'])}"
        )
    return rows


def seen(data: Data, spec: Spec) -> Rows:
    """``bench/seen_exclusion.py``: seen items skipped inside the scan, against searching
    ``K + S`` and striking the seen afterwards (what a plain ANN library leaves a caller)."""
    return [
        f"{r['seen']:,} | {r['batch']} | {r['in scan']['us_per_query']:,.0f} µs | "
        f"{r['budget']['us_per_query']:,.0f} µs | {bold(r['budget']['us_per_query'] / r['in scan']['us_per_query'])} | "
        f"{r['same_ids']:.4f}"
        for r in data["rows"]
    ]


def freshness(data: Data, spec: Spec) -> Rows:
    """``bench/freshness.py``: live updates through the fresh segment against the copy of the
    index every update made before, and what the segment costs a search."""
    case = spec["case"]
    rows = [
        f"{case} | {u['kind']}, {u['batch']:,}-item batches | {qps(u['ours_items_per_s'])} items/s | "
        f"copy per update: {qps(u['copy_items_per_s'])} items/s | {bold(u['ratio'])}"
        for u in data["updates"]
    ]
    ack, mem = data["ack_to_answer"], data["memory"]
    rows.append(
        f"{case} | upsert acknowledged → answerable | {ms(ack['median_ms'])} ms median | — | —"
    )
    rows.append(
        f"{case} | extra memory, a {mem['batch']:,}-item upsert | {mem['rss_bytes_per_batch'] / 1e6:.2f} MB resident "
        f"({mem['segment_bytes_per_batch'] / 1e6:.2f} MB segment) | — | —"
    )
    for f in data["search"]:
        rows.append(
            f"{case} | search beside {f['fresh']:,} {'tombstones' if f.get('segment') == 'tombstones' else 'fresh rows'} | {qps(f['qps'])} q/s, p50 {ms(f['p50_ms'])} ms | "
            f"none: {qps(f['qps_without'])} q/s, p50 {ms(f['p50_ms_without'])} ms | "
            f"{ratio(f['qps_ratio'])} q/s, {ratio(f['p50_ratio'])} p50"
        )
    r = data["recall@100"]
    rows.append(
        f"{case} | recall@100 after {r['upserts']:,} upserts + {r['removes']:,} removes | live {r['live']:.4f}, "
        f"folded {r['folded']:.4f} | rebuilt from scratch {r['rebuilt']:.4f} | "
        f"**{r['folded'] - r['rebuilt']:+.4f}** folded"
    )
    return rows


def freshness_serving(data: Data, spec: Spec) -> Rows:
    """``bench/freshness_serving.py``: searches served at half the max q/s while updates are
    applied at each setting of the rates, against the same searches with no updates."""
    case = spec["case"]
    rows = []
    for st in data["settings"]:
        t, got = st["target_per_s"], st["updates_per_s"]
        quiet, busy, ans = st["served"]["quiet"], st["served"]["updates"], st["answerable_ms"]
        aim = f"{qps(t['upsert'])} / {qps(t['flip'])} / {qps(t['remove'])}"
        rows.append(
            f"{case} | updates/s asked: {aim} (upsert / flip / remove) | achieved "
            f"{qps(got['upsert'])} / {qps(got['flip'])} / {qps(got['remove'])}, "
            f"{st['compactions']} compactions | — | —"
        )
        rows.append(
            f"{case} | served p99 at {qps(data['served_qps'])} q/s, updates {aim} | "
            f"{ms(busy['p99_ms'])} ms ({busy['n']:,} served, {busy['backlog']:,} behind) | "
            f"no updates: {ms(quiet['p99_ms'])} ms | {bold(st['p99_ratio'])}"
        )
        rows.append(
            f"{case} | upsert acknowledged → answered while serving, updates {aim} | "
            f"{ms(ans['median'])} ms median, {ms(ans['max'])} ms max ({ans['n']}) | — | —"
        )
    return rows


def filters(data: Data, spec: Spec) -> Rows:
    """``bench/filters.py``: filtered top-K under an OR expression (each system at its cheapest
    setting reaching the run's recall target, q/s the median of turns) against the fastest
    peer; evaluating the expression over the catalog against NumPy over the columns."""
    tk, ev = data["top_k"], data["evaluation"]
    target = float(data["meta"]["args"]["target"])
    qps = tk["turns_qps"]
    peers = {n: v for n, v in qps.items() if not n.startswith("ours")}
    peer = max(peers, key=lambda n: peers[n])
    ours = qps.get("ours")
    rows = [
        f"top-{tk['k']} at recall ≥ {target}, {tk['items']:,} × {tk['dim']}, "
        f"{100 * tk['selectivity']:.1f} % pass | "
        + (f"{ours:,.0f} q/s" if ours else "not reached")
        + f" | {peer}: {peers[peer]:,.0f} q/s | "
        + (bold(ours / peers[peer]) if ours else "")
    ]
    if (forced := qps.get("ours, the exact plan (exact=True)")) is not None:
        rows.append(
            f"the same, our exact plan forced (exact=True) | {forced:,.0f} q/s | {peer}: "
            f"{peers[peer]:,.0f} q/s | {bold(forced / peers[peer])}"
        )
    mine = ev["ours, eligible_positions (C++, postings)"]["ms"]
    cols = ev["NumPy over the attribute columns"]["ms"]
    rows.append(
        f"the items it admits, {ev['items']:,} items, {100 * ev['selectivity']:.1f} % pass "
        f"(same items: {ev['same_items']}) | {mine:.2f} ms | NumPy over the columns: "
        f"{cols:.2f} ms | {bold(cols / mine)}"
    )
    return rows


def selectivity(data: Data, spec: Spec) -> Rows:
    """``bench/selectivity.py``: per expression, the truth, the sampled estimate and the
    independent one ("as before"), each one's plan, recall@K and q/s (the same index, in turns)."""
    rows = []
    for c in data["result"]["cases"]:
        s, b = c["sampled"], c["as before"]

        def plan(p: dict[str, Any]) -> str:
            return ", ".join(f"{k} {v}" for k, v in p["kinds"].items())

        rows.append(
            f"`{c['text']}` | {100 * c['truth']:.3f} % | {100 * s['estimate']:.3f} % / "
            f"{100 * b['estimate']:.3f} % | {plan(s)} / {plan(b)} | {s['recall']:.3f} / "
            f"{b['recall']:.3f} | {qps(s['qps'])} / {qps(b['qps'])} | {bold(s['qps'] / b['qps'])}"
        )
    return rows


def filters_hashed(data: Data, spec: Spec) -> Rows:
    """``bench/filters.py --hashed``: a 10^6-value attribute's bytes an item, and evaluating
    expressions naming it (``eligible_positions``) against NumPy over the columns, with the
    false positives of the compiled test (before any check against the exact values)."""
    h = data["hashed"]
    b = h["bytes_an_item"]
    rows = [
        f"bytes an item, a {h['values']:,}-value creator on {h['items']:,} items ({h['bits_an_item']}"
        f" bits) | {b['total']:.2f} (signature {b['sig']:.2f}, postings {b['postings']:.2f}"
        + (
            f", its values' {b['value_postings'] + b['value_offsets']:.2f}"
            if "value_postings" in b
            else ""
        )
        + ") | "
        f"one bit a value: {h['bytes_an_item_one_bit_a_value']:,.0f} | target ≤ 16: "
        + ("**met**" if b["total"] <= 16 else "missed")
    ]
    for c in h["cases"].values():
        ours = c["ms"]["ours, eligible_positions (C++, postings)"]
        cols = c["ms"]["NumPy over the attribute columns"]
        rows.append(
            f"`{c['text']}`: {c['admitted']:,} items, {c['false_positives']} false positives, "
            f"{c['missed']} missed | {ms(ours)} ms | NumPy over the columns: {ms(cols)} ms | "
            f"{bold(cols / ours)}"
        )
    return rows


def filters_silvertorch(data: Data, spec: Spec) -> Rows:
    """``bench/filters.py``'s SilverTorch part: our exact evaluation of OR-groups over the catalog
    (``eligible_positions``, the index's own call, positions out) against SilverTorch's Bloom search (a candidate mask with
    false positives) and its search plus exact verification (equal answers), and bytes per item."""
    st = data["silvertorch"]
    if "skipped" in st:
        return [f"not measured | {st['skipped']} | | "]
    ours_way = "ours, eligible_positions (exact positions, C++)"
    bloom = "silvertorch, bloom_index_search_batch (bool mask)"
    verified = "silvertorch, bloom search + exact verification (positions)"
    rows = []
    for g, r in st["groups"].items():
        ms, fp = r["ms"], r["false_positives"]
        case = (
            f"{g} OR-groups, {st['items']:,} docs, {100 * r['selectivity']:.1f} % pass "
            f"(equal answers: {r['equal_answers']})"
        )
        rows.append(
            f"{case} | {ms[ours_way]:.2f} ms, {fp['ours']} false positives | Bloom search: "
            f"{ms[bloom]:.2f} ms, {fp['silvertorch candidates']:,} false positives | "
            + bold(ms[bloom] / ms[ours_way])
        )
        rows.append(
            f"the same, its candidates verified exactly (our torch verification over the value "
            f"lists) | {ms[ours_way]:.2f} ms | "
            f"{ms[verified]:.2f} ms | " + bold(ms[verified] / ms[ours_way])
        )
    b = st["bytes_per_item"]
    sig, sliced = b["ours, signatures"], b["ours, bit slices"]
    rows.append(
        f"bytes per document | signatures {sig:.0f} + bit slices {sliced:.0f} = "
        f"{sig + sliced:.0f} (postings, where kept: "
        f"+{b['ours, signatures + postings'] - sig:.0f})"
        f" | Bloom index {b['silvertorch, bloom index']:.0f} (+ value lists "
        f"{b['value lists (its exact verification)']:.0f} to verify) | "
    )
    if "peak_rss_gib" in st:
        build = st["build_s"]
        rows.append(
            f"build, {st['items']:,} docs (the run's peak memory "
            f"{st['peak_rss_gib']:.1f} GiB) | signatures, postings, slices "
            f"{build['ours (signatures, postings, slices)']:.0f} s | Bloom index "
            f"{build['silvertorch bloom']:.0f} s | "
        )
    return rows


def filters_silvertorch_top_k(data: Data, spec: Spec) -> Rows:
    """``bench/filters.py --st-top-k``: filtered top-K end to end, ours against SilverTorch's
    two CPU pipelines, each at its cheapest nprobe reaching the target recall."""
    st = data["silvertorch_top_k"]
    if "skipped" in st:
        return [f"not measured | {st['skipped']} | | "]
    target = float(data["meta"]["args"]["target"])

    def point(f: Data, system: str) -> tuple[str, float | None]:
        reach = [p for p in f["points"][system] if p["recall"] >= target]
        q = f["turns_qps"].get(system)
        if not reach or q is None:
            return "recall not reached", None
        b = max(reach, key=lambda p: p["qps"])
        probe = f"nprobe {b['nprobe']}, " if b["nprobe"] else ""
        return f"{probe}recall {b['recall']:.3f}, {qps(q)} q/s", q

    rows = []
    for name, f in st["filters"].items():
        ours, ours_q = point(f, "ours")
        for system in f["points"]:
            if system == "ours":
                continue
            theirs, their_q = point(f, system)
            speed = bold(ours_q / their_q) if ours_q and their_q else ""
            rows.append(
                f"{name}, {100 * f['selectivity']:.1f} % pass, {st['items']:,} x {st['dim']} | "
                f"{ours} | {system.removeprefix('silvertorch, ')}: {theirs} | {speed}"
            )
    return rows


Kind = Callable[[Data, Spec], Rows]
BYTES_HEAD = "data | ours, bytes/item | smallest faiss IVF at recall ≥ 0.95 | ours over it"
KINDS: dict[str, tuple[Kind, str]] = {
    "ann": (
        ann,
        "data, path | filter | recall ≥ | ours: setting, recall, q/s | fastest peer at that recall | batched, ours ÷ peer | one query p50 ms: ours / fastest peer | one query, ours ÷ peer",
    ),
    "ann_build": (
        ann_build,
        "data | ours | fastest faiss build | ours ÷ faiss (≤ 1 meets) | in turns",
    ),
    "ann_bytes": (ann_bytes, BYTES_HEAD),
    "index_bytes": (index_bytes, BYTES_HEAD),
    "filtered": (
        filtered,
        "data | filter | ours: recall, q/s | fastest peer at recall ≥ 0.95 | ours ÷ peer",
    ),
    "filters": (filters, "case | ours | fastest peer | ours ÷ peer (speed)"),
    "filters_hashed": (filters_hashed, "case | ours | peer | ours ÷ peer (speed)"),
    "selectivity": (
        selectivity,
        "expression | admits | estimate: sampled / as before | plan: sampled / as before | recall@100: sampled / as before | q/s: sampled / as before | sampled ÷ as before",
    ),
    "filters_silvertorch": (
        filters_silvertorch,
        "case | ours (exact) | SilverTorch CPU | it ÷ ours (speed)",
    ),
    "filters_silvertorch_top_k": (
        filters_silvertorch_top_k,
        "filter, documents | ours: setting, recall@100, q/s | SilverTorch CPU pipeline | ours ÷ it (q/s)",
    ),
    "seen": (
        seen,
        "seen items S | batch | skipped in the scan, a query | K + S, then struck | its time ÷ ours | same ids",
    ),
    "serving": (serving, "run | ours: max q/s at p99 ≤ 20 ms | peer | ours ÷ peer | target"),
    "serving_points": (serving_points, "case | clients | ours | peer | ours ÷ peer"),
    "sharding": (
        sharding,
        "configuration | filter | routed: max q/s at p99 ≤ 20 ms | serve, same turns | routed ÷ serve | p50 at 1 client − serve's | servers' CPU a request",
    ),
    "netns": (
        netns,
        "network | routed, 1 shard: max q/s at p99 ≤ 20 ms | serve, same turns | routed ÷ serve | p50 at 1 client: routed / serve | routed calls refused",
    ),
    "netns_tier": (
        netns_tier,
        "network | Recommend p50 at 1 client: remote tier / all local | remote ÷ local (p50) | max q/s at p99 ≤ 20 ms: remote / local | remote ÷ local (q/s) | calls refused: remote / local",
    ),
    "relay_cost": (
        relay_cost,
        "relay, profile | connections | through the relay: round trips/s, p50 | direct | profile's round trip delay | p50 beyond direct + profile | relay CPU a round trip",
    ),
    "remote_hot": (remote_hot, "filter | clients | p50 ÷ all tables local | q/s ÷ local | target"),
    "gpu": (
        gpu,
        "items | filter passes | batch | ours | GEMM + topk (exact, same GPU) | ours ÷ exact | recall ours / exact",
    ),
    "tables": (tables, "ids | dtype | ours | fastest peer | ours ÷ peer"),
    "quality": (quality, "data | ours | recall@100 | best baseline | ours ÷ baseline"),
    "freshness": (freshness, "data | measure | ours | against | ours ÷ against"),
    "freshness_serving": (
        freshness_serving,
        "data | measure | with updates | against | ours ÷ against",
    ),
    "hashed": (
        hashed,
        "case | working rows | recall@100 | examples/s | recall − all resident (target ≥ −0.01) | speed ÷ all resident",
    ),
    "train": (train, "data | ours | pairs/s | fastest TorchRec loop | ours ÷ peer"),
    "train_dmp": (train_dmp, "data | case | examples/s | against | case ÷ ours"),
}
