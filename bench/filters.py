"""Filter expressions: evaluating one over the catalog per query, and filtered top-K with an OR
expression at about 5 % selectivity against faiss ``IVF{nlist},SQ8`` and ``IVF{nlist},Flat``, each
with an ``IDSelectorBitmap`` (SQ8's scanner falls to a scalar loop where the dimension is not a
multiple of its width, so at 50-d the best faiss is Flat), and the exact scan of the eligible
ids, each at its cheapest setting reaching the recall target.

Items carry ``category`` (20 values), ``language`` (8), ``creator`` (200) and a numeric
``price``; the expression is ``(category in {...} or creator in {...}) and language != ...
and price < P`` (an OR across attributes, a negation, a range).

1. Evaluation (``--eval-n`` items, 1M by default; no vectors): the items one expression admits,
   one query at a time: ours from the compiled clauses (``eligible_positions``: the C++ pass
   over the most selective clause's postings; and ``eligible`` in torch over every signature),
   against NumPy evaluating the same expression over the attribute columns (what a column store
   does). All three must return the same items (checked, the count is recorded).
2. Filtered top-K (``--n`` x ``--d``): one batch of queries sharing the filter, q/s at the
   cheapest nprobe reaching ``--target`` recall@K, for our index (its plan: lists or the exact
   scan), faiss SQ8 and Flat + bitmap, and the gather + matmul exact scan of the eligible ids
   (torch).
3. Against SilverTorch's CPU Bloom search (``filters_silvertorch.py``) on its benchmark's shape,
   when it is importable (or built in ``--silvertorch-path``); the JSON says why not otherwise.
   With ``--st-top-k``, filtered top-K end to end against its pipeline on those documents
   (``filters_silvertorch_topk.py``: its Bloom search + fused int8 ANN, ``--st-n`` x ``--d``).

4. Hashed attribute (``--hashed``, its own JSON: ``bench/results/filters_hashed.json``): a
   ``creator`` of 10^6 values on ``--eval-n`` items (hashed: 6 hex digits, 96 bits), the bytes
   an item it adds (signature words, bit postings and its values' postings, against the same
   index without it), and
   evaluating expressions that name it (ours: ``eligible_positions`` and ``eligible``; NumPy
   over the columns), with the items our compiled test admits before any check against the
   exact values: its false positives, counted.

Run from the repository root::

    .venv/bin/python bench/filters.py --small      # ~1 min: 100k evaluation, 20k x 32 search
    .venv/bin/python bench/filters.py              # 1M evaluation, 200k x 64 search
    .venv/bin/python bench/filters.py --d 50 --out bench/results/filters_50d.json   # 200k x 50
    .venv/bin/python bench/filters.py --hashed     # part 4 alone, 1M items
    .venv/bin/python bench/filters.py --silvertorch-path DIR   # a built SilverTorch checkout
    .venv/bin/python bench/filters.py --skip-top-k --st-groups "" --st-top-k --silvertorch-path DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from ann_data import exact_topk, make_data, recall_at_k
from ann_peers import EligibleScan, bitmap_selector, build_faiss_ivfs, faiss_search, ivf_params
from filters_silvertorch import compare, load_silvertorch, queries
from filters_silvertorch import render as render_silvertorch
from filters_silvertorch_topk import render as render_st_top_k
from filters_silvertorch_topk import top_k as st_top_k
from timing import set_threads, stopwatch, time_batched

from common.atomic import atomic_write_json
from retrieval.filters import NUMERIC, eligible
from retrieval.index import IVFConfig, build_ivf
from retrieval.index.eligible_scan import eligible_positions
from retrieval.index.plan import RowKind

VOCAB: dict[str, Any] = {
    "category": [f"c{i}" for i in range(20)],
    "language": [f"l{i}" for i in range(8)],
    "creator": [f"k{i}" for i in range(200)],
    "price": NUMERIC,
}
TEXT = "(category in {c0, c1} or creator in {k0, k1, k2, k3, k4}) and language != l0 and price < 40"


def attributes(n: int, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "category": rng.integers(0, 20, n),
        "language": rng.integers(0, 8, n),
        "creator": rng.integers(0, 200, n),
        "price": np.round(rng.gamma(2.0, 25.0, n), 2),
    }


def numpy_columns(a: dict[str, np.ndarray]) -> np.ndarray:
    """The expression over the columns -> ``[M]`` admitted positions (float32 prices, as stored)."""
    keep = (np.isin(a["category"], [0, 1]) | np.isin(a["creator"], [0, 1, 2, 3, 4])) & (
        a["language"] != 0
    )
    return np.flatnonzero(keep & (a["price"].astype(np.float32) < np.float32(40)))


def evaluation(n: int, repeats: int) -> dict[str, Any]:
    """Part 1: ms per query of each way, and the items admitted."""
    a = attributes(n)
    build = build_ivf(
        torch.randn(n, 8),
        IVFConfig(nlist=16, measure_costs=False),
        item_attributes=a,
        attribute_values=VOCAB,
    )  # the index's signatures and postings; its vectors do not matter here
    t = build.tensors()
    fb = build.compile_filter(TEXT, 1)
    masks, negate = fb.masks[0], fb.negate[0]
    ways = {
        "ours, eligible_positions (C++, postings)": lambda: eligible_positions(t, masks, negate),
        "ours, eligible over every signature (torch)": lambda: (
            eligible(t.lists.sig, masks, negate).nonzero().flatten()
        ),
        "NumPy over the attribute columns": lambda: numpy_columns(a),
    }
    out: dict[str, Any] = {"items": n, "clauses": int(masks.shape[0]), "words": int(masks.shape[1])}
    admitted = {}
    for name, fn in ways.items():
        pos = np.asarray(fn())
        ids = pos if name.startswith("NumPy") else build.item_ids[torch.as_tensor(pos)].numpy()
        admitted[name] = np.sort(ids)
    for name, s in in_turns(ways, repeats).items():
        out[name] = {"ms": s * 1e3, "admitted": len(admitted[name])}
    first = next(iter(admitted.values()))
    out["same_items"] = all(np.array_equal(first, v) for v in admitted.values())
    out["selectivity"] = len(first) / n
    return out


HASHED_VALUES = 10**6
HASHED_TEXTS = {
    "one creator": "creator = k123457",
    "5 creators": "creator in {k1, k77, k5000, k123457, k999999}",
    "OR across attributes, negation": (
        "(category = c0 or creator in {k1, k77, k5000, k123457, k999999}) and language != l0"
    ),
    "creator not in 5, a category": (
        "category = c3 and creator not in {k1, k77, k5000, k123457, k999999}"
    ),
}


def hashed_columns(a: dict[str, np.ndarray], name: str) -> np.ndarray:
    """``HASHED_TEXTS[name]`` over the columns -> ``[M]`` admitted positions."""

    def five() -> np.ndarray:
        return np.isin(a["creator"], [1, 77, 5000, 123457, 999999])

    keep = {
        "one creator": lambda: a["creator"] == 123457,
        "5 creators": five,
        "OR across attributes, negation": lambda: (
            ((a["category"] == 0) | five()) & (a["language"] != 0)
        ),
        "creator not in 5, a category": lambda: (a["category"] == 3) & ~five(),
    }[name]()
    return np.flatnonzero(keep)


def hashed_attribute(n: int, repeats: int) -> dict[str, Any]:
    """Part 3: bytes an item of a 10^6-value attribute, and evaluation of expressions naming
    it (ms a query, items admitted, false positives of the compiled test)."""
    rng = np.random.default_rng(11)
    a = {
        "category": rng.integers(0, 20, n),
        "language": rng.integers(0, 8, n),
        # a few creators hold many items, as feeds' do; the rest spread over the vocabulary
        "creator": np.where(
            rng.random(n) < 0.01,
            rng.choice([1, 77, 5000, 123457, 999999], n),
            rng.integers(0, HASHED_VALUES, n),
        ),
    }
    vocab = {"category": VOCAB["category"], "language": VOCAB["language"]}
    x, cfg = torch.randn(n, 8), IVFConfig(nlist=16, measure_costs=False)
    base = build_ivf(
        x, cfg, item_attributes={k: a[k] for k in vocab}, attribute_values=vocab
    ).memory_bytes()
    creators = [f"k{i}" for i in range(HASHED_VALUES)]
    build = build_ivf(x, cfg, item_attributes=a, attribute_values={**vocab, "creator": creators})
    mem = build.memory_bytes()
    out: dict[str, Any] = {
        "items": n,
        "values": HASHED_VALUES,
        "digits": build.schema.hashed_digits["creator"],
        "bits_an_item": build.schema.hashed_digits["creator"] * 16,
        "bytes_an_item": {
            k: (mem[k] - base[k]) / n
            for k in ("sig", "postings", "bit_counts", "value_postings", "value_offsets")
        },
        "bytes_an_item_one_bit_a_value": HASHED_VALUES / 8,
        "cases": {},
    }
    out["bytes_an_item"]["total"] = sum(out["bytes_an_item"].values())
    t = build.tensors()
    for name, text in HASHED_TEXTS.items():
        fb = build.compile_filter(text, 1)
        masks, negate = fb.masks[0], fb.negate[0]
        ways = {
            "ours, eligible_positions (C++, postings)": lambda m=masks, g=negate: (
                eligible_positions(t, m, g)
            ),
            "ours, eligible over every signature (torch)": lambda m=masks, g=negate: (
                eligible(t.lists.sig, m, g).nonzero().flatten()
            ),
            "NumPy over the attribute columns": lambda name=name: hashed_columns(a, name),
        }
        truth = np.sort(hashed_columns(a, name))
        case: dict[str, Any] = {
            "text": text,
            "clauses": int(masks.shape[0]),
            "admitted": len(truth),
        }
        # what the compiled test admits, before any check against the exact values
        compiled = np.sort(build.item_ids[eligible_positions(t, masks, negate)].numpy())
        case["false_positives"] = int(np.setdiff1d(compiled, truth).size)
        case["missed"] = int(np.setdiff1d(truth, compiled).size)
        case["ms"] = {k: v * 1e3 for k, v in in_turns(ways, repeats).items()}
        out["cases"][name] = case
    return out


def render_hashed(h: dict[str, Any]) -> str:
    b = h["bytes_an_item"]
    lines = [
        f"Hashed creator of {h['values']:,} values on {h['items']:,} items: {h['digits']} digits,"
        f" {h['bits_an_item']} bits; bytes an item over the index without it: signature "
        f"{b['sig']:.2f}, bit postings {b['postings']:.2f}, its values' postings "
        f"{b['value_postings']:.2f} and offsets {b['value_offsets']:.2f}, total {b['total']:.2f} "
        "(one bit a value: "
        f"{h['bytes_an_item_one_bit_a_value']:,.0f})",
        "| expression | clauses | admitted | false positives | eligible_positions ms | "
        "torch eligible ms | NumPy ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in h["cases"].items():
        m = list(c["ms"].values())
        lines.append(
            f"| {name} | {c['clauses']} | {c['admitted']:,} | {c['false_positives']} | "
            f"{m[0]:.2f} | {m[1]:.2f} | {m[2]:.2f} |"
        )
    return "\n".join(lines)


def in_turns(fns: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median seconds of one call of each of ``fns``, timed in turns (A B C A B C ...), so the
    shared machine's load falls on all of them alike."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            elapsed = stopwatch()
            fn()
            runs[name].append(elapsed())
    return {name: float(np.median(r)) for name, r in runs.items()}


def sweep(fn, truth: np.ndarray, settings: list[int], target: float, repeats: int) -> list[dict]:
    """Each setting's recall and q/s, up to the first that reaches ``target``."""
    points = []
    for s in settings:
        ids, median_s, _ = time_batched(lambda s=s: fn(s), repeats=repeats)
        points.append(
            {"nprobe": s, "recall": recall_at_k(ids, truth), "qps": len(truth) / median_s}
        )
        if points[-1]["recall"] >= target:
            break
    return points


def top_k(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: filtered top-K, ours against faiss SQ8 and Flat + bitmap and the exact eligible
    scan."""
    data = make_data(args.n, args.d, args.queries)
    a = attributes(args.n, seed=8)
    keep = np.zeros(args.n, bool)
    keep[numpy_columns(a)] = True
    truth = exact_topk(data.x, data.q, args.k, np.flatnonzero(keep))
    elapsed = stopwatch()
    index = build_ivf(
        torch.from_numpy(data.x),
        IVFConfig(nlist=args.nlist),
        item_attributes=a,
        attribute_values=VOCAB,
    )
    build_s = elapsed()
    q = torch.from_numpy(data.q)
    probes = [2**i for i in range(12) if 2**i <= args.nlist]

    def ours(p: int) -> np.ndarray:
        return index.search(q, args.k, TEXT, nprobe=p)[0].numpy()

    faiss_builds, _ = build_faiss_ivfs(data.x, args.nlist, min(args.n, 100 * args.nlist))
    sq8, sel = faiss_builds["faiss-IVF-SQ8"].index, bitmap_selector(keep)
    flat = faiss_builds["faiss-IVF-Flat"].index  # SQ8 scans a scalar loop at some dims (50, ...)
    params = {p: ivf_params(p, sel) for p in probes}
    scan, eligible_ids = (
        EligibleScan(torch.from_numpy(data.x)),
        torch.from_numpy(np.flatnonzero(keep)),
    )
    systems = {
        "ours": (ours, probes),
        "ours, the exact plan (exact=True)": (
            lambda _: index.search(q, args.k, TEXT, exact=True)[0].numpy(),
            [0],
        ),
        "faiss-IVF-SQ8 + bitmap": (lambda p: faiss_search(sq8, data.q, args.k, params[p]), probes),
        "faiss-IVF-Flat + bitmap": (
            lambda p: faiss_search(flat, data.q, args.k, params[p]),
            probes,
        ),
        "exact scan of the eligible ids (torch)": (
            lambda _: scan.search(q, args.k, eligible_ids),
            [0],
        ),
    }
    points = {n: sweep(fn, truth, s, args.target, args.repeats) for n, (fn, s) in systems.items()}
    chosen = {n: best(points[n], args.target) for n in systems}
    fns = {n: (lambda fn=systems[n][0], c=c: fn(c["nprobe"])) for n, c in chosen.items() if c}
    turns = {n: len(truth) / s for n, s in in_turns(fns, args.rounds).items()}
    p = chosen["ours"]["nprobe"] if chosen["ours"] else 1
    plan = index.executor.plans.plan(
        index.tensors(), index.compile_filter(TEXT, len(q)), index.params(args.k, p, 0), q
    )  # which plan ours ran (lists or the exact scan: the build's measured costs choose)
    kinds = {
        RowKind(int(k)).name: int(c)
        for k, c in zip(*np.unique(plan.kind.numpy(), return_counts=True), strict=True)
    }
    return {
        "turns_qps": turns,
        "plan_kinds": kinds,
        "items": args.n, "dim": args.d, "nlist": args.nlist, "k": args.k, "queries": args.queries,
        "selectivity": float(keep.mean()), "build_s": build_s, "points": points,
    }  # fmt: skip


ST_FILTERS = {  # its benchmark's query, and one that keeps about 6 % (4 values of 2 in 4)
    "10 OR-groups of 5 values (its benchmark)": queries(10, 10, 10, 5),
    "4 single values": queries(4, 10, 10, 5, per_group=1),
}


def silvertorch_top_k(args: argparse.Namespace) -> dict[str, Any]:
    """Part 4 (``filters_silvertorch_topk.py``), with this file's sweep and turns."""
    return st_top_k(
        args.st_n, args.d, args.queries, args.k, args.nlist, args.target,
        lambda fn, truth, settings, target: sweep(fn, truth, settings, target, args.repeats),
        best, in_turns, args.rounds, ST_FILTERS,
    )  # fmt: skip


def best(points: list[dict], target: float) -> dict | None:
    reached = [p for p in points if p["recall"] >= target]
    return max(reached, key=lambda p: p["qps"]) if reached else None


def render(ev: dict[str, Any], tk: dict[str, Any], target: float) -> str:
    lines = [
        f"Evaluation over {ev['items']:,} items ({ev['clauses']} clauses x {ev['words']} words; "
        f"selectivity {ev['selectivity']:.3f}; same items: {ev['same_items']})",
        "| way | ms a query | admitted |",
        "|---|---|---|",
    ]
    for name, r in ev.items():
        if isinstance(r, dict):
            lines.append(f"| {name} | {r['ms']:.2f} | {r['admitted']:,} |")
    if not tk:
        return "\n".join(lines)
    lines += [
        "",
        f"Filtered top-{tk['k']}, {tk['items']:,} x {tk['dim']} (selectivity {tk['selectivity']:.3f})"
        f", cheapest setting reaching recall {target}; our plan's rows: {tk['plan_kinds']}",
        "| system | nprobe | recall | q/s (median of the turns) |",
        "|---|---|---|---|",
    ]
    for name, pts in tk["points"].items():
        b, qps = best(pts, target), tk["turns_qps"].get(name)
        cells = (
            "not reached | |"
            if b is None or qps is None
            else f"{b['nprobe']} | {b['recall']:.3f} |"
        )
        lines.append(f"| {name} | {cells} {'' if qps is None else f'{qps:,.0f}'} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="100k evaluation, 20k x 32 search")
    p.add_argument("--hashed", action="store_true", help="part 3 alone (filters_hashed.json)")
    p.add_argument("--eval-n", type=int, default=1_000_000)
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each sweep setting")
    p.add_argument("--rounds", type=int, default=15, help="turns timing the chosen settings")
    p.add_argument("--silvertorch-path", type=Path, default=None, help="a built checkout")
    p.add_argument("--st-n", type=int, default=1_000_000, help="documents against SilverTorch")
    p.add_argument("--st-groups", default="2,10", help="OR-group counts against SilverTorch")
    p.add_argument("--st-top-k", action="store_true", help="filtered top-K against SilverTorch")
    p.add_argument("--skip-top-k", action="store_true", help="parts 1 and 3 only")
    p.add_argument("--out", type=Path, default=Path("bench/results/filters.json"))
    args = p.parse_args(argv)
    if args.small:
        args.eval_n, args.n, args.d, args.nlist, args.st_n = 100_000, 20_000, 32, 128, 100_000
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    wall, load_start = stopwatch(), os.getloadavg()
    if args.hashed:
        h = hashed_attribute(args.eval_n, args.rounds)
        report = render_hashed(h)
        print(report)
        out = args.out.with_name(args.out.stem + "_hashed.json")
        meta = {
            "argv": sys.argv[1:] if argv is None else argv,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "wall_s": wall(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
        }
        atomic_write_json(out, {"meta": meta, "hashed": h, "markdown": report}, indent=1)
        print(f"\nwrote {out} in {wall():.0f} s", file=sys.stderr)
        return
    ev = evaluation(args.eval_n, args.rounds)
    tk = {} if args.skip_top_k else top_k(args)
    report = render(ev, tk, args.target)
    loaded, where = load_silvertorch(args.silvertorch_path)
    st: dict[str, Any] = {"skipped": where if args.st_groups else "no --st-groups"}
    st_tk: dict[str, Any] = {"skipped": where if args.st_top_k else "no --st-top-k"}
    if loaded:
        groups = [int(g) for g in args.st_groups.split(",") if g]
        if groups:
            st = {"from": where, **compare(args.st_n, groups, args.rounds, in_turns)}
            report += "\n\n" + render_silvertorch(st)
        if args.st_top_k:
            st_tk = {"from": where, **silvertorch_top_k(args)}
            report += "\n\n" + render_st_top_k(st_tk, args.target)
    else:
        report += f"\n\nAgainst SilverTorch: skipped, {where}"
    print(report)
    meta = {
        "argv": sys.argv[1:] if argv is None else argv,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "text": TEXT,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cores": os.cpu_count(),
        "faiss": faiss.__version__,
        "torch": torch.__version__,
        "wall_s": wall(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    atomic_write_json(
        args.out,
        {
            "meta": meta,
            "evaluation": ev,
            "top_k": tk,
            "silvertorch": st,
            "silvertorch_top_k": st_tk,
            "markdown": report,
        },
        indent=1,
    )
    print(f"\nwrote {args.out} in {wall():.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
