"""The index on a GPU: our fused Triton search vs exact search as one GEMM + ``torch.topk`` on the
same GPU (the brute-force ceiling faiss-gpu's flat index rests on) vs our CPU path.

For each catalog size (clustered synthetic vectors, 64-d by default) it builds one IVF index
(INT8 codes, no exact copy) and, for every batch size, K and filter (none, and attributes passing
50 / 5 / 0.5 % of the items), times whole searches (``index.search``: plan, probe, fused scan and
filter, top-K, ids; synchronised) and reports q/s, p50 / p99 per batch, recall@K against exact
float32 search, and the index's bytes per item on the device. nprobe is the smallest of
``--nprobes`` reaching ``--target`` recall@100 unfiltered at the largest batch.

Before timing, ``--check`` runs the Triton kernel against the torch reference (``scan_reference``)
on the device, over random lists, filters and exclusions, and stops on any difference (with
``--device cpu``, under Triton's interpreter on smaller lists: how ``tests/bench/test_gpu_check.py``
runs it).

    python bench/gpu.py --device cuda --out gpu_h100.json          # on a GPU machine
    python bench/gpu.py --device cpu --sizes 1000000 --batches 1,16,128 --out gpu_cpu.json
    python bench/gpu.py --render bench/results/gpu_h200.json    # the tables of bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import percentiles

from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.scan import KERNEL_ENV, scan_reference
from retrieval.index.tensors import Lists, ScanRows

FILTERS = {1.0: None, 0.5: "a50 = 0", 0.05: "a5 = 0", 0.005: "a05 = 0"}
"""Selectivity -> the filter passing that share of the items (attribute values are uniform)."""
VALUES = {"a50": 2, "a5": 20, "a05": 200}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda or cpu (our CPU path)")
    p.add_argument("--sizes", default="1000000,10000000", help="catalog sizes, comma-separated")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batches", default="1,16,128,1024", help="batch sizes, comma-separated")
    p.add_argument("--ks", default="100,1000", help="K values, comma-separated")
    p.add_argument("--selectivities", default="1,0.5,0.05,0.005", help="filters by selectivity")
    p.add_argument("--nprobes", default="16,32,64,128,256", help="nprobe candidates")
    p.add_argument("--target", type=float, default=0.95, help="recall@100 nprobe is chosen for")
    p.add_argument("--budget-s", type=float, default=0.4, help="seconds of timed runs per cell")
    p.add_argument("--no-brute", action="store_true", help="skip the GEMM + topk baseline")
    p.add_argument("--check", action="store_true", help="check the kernel on the device first")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write torch.profiler tables of unfiltered searches (B = 1 and the largest) here",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def clustered(n: int, d: int, seed: int, device: str) -> torch.Tensor:
    """``[n, d]`` float32: Gaussian centres (x3) plus unit noise, made on ``device`` in chunks."""
    g = torch.Generator(device=device).manual_seed(seed)
    centres = torch.randn(max(16, n // 1000), d, generator=g, device=device) * 3
    out = torch.empty(n, d, device=device)
    for s in range(0, n, 1 << 22):
        m = min(1 << 22, n - s)
        pick = torch.randint(0, centres.shape[0], (m,), generator=g, device=device)
        out[s : s + m] = centres[pick] + torch.randn(m, d, generator=g, device=device)
    return out


def time_calls(fn: Callable[[], object], device: str, budget_s: float) -> list[float]:
    """Seconds per call: one warm-up, then at least 5 calls or ``budget_s`` of them."""
    fn()
    sync(device)
    runs: list[float] = []
    start = time.perf_counter()
    while len(runs) < 5 or (time.perf_counter() - start < budget_s and len(runs) < 2000):
        t0 = time.perf_counter()
        fn()
        sync(device)
        runs.append(time.perf_counter() - t0)
    return runs


def summary(runs: list[float], b: int) -> dict:
    """Seconds per call of a ``b``-query batch -> q/s at the median, p50 / p99 ms."""
    p50, p99 = percentiles([t * 1e3 for t in runs])
    return {"qps": b / (p50 / 1e3), "p50_ms": p50, "p99_ms": p99, "runs": len(runs)}


def recall(found: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean |found ∩ truth| / |truth| per row (``-1`` ignored), on the device."""
    f, t = found.long(), truth.long()
    hit = (f.unsqueeze(2) == t.unsqueeze(1)) & (t.unsqueeze(1) >= 0)
    return float(hit.any(1).sum() / (t >= 0).sum().clamp(min=1))


class Brute:
    """Exact search as GEMM + topk over ``x`` in float16 on the device, in query chunks
    (the score block stays under ~2 GB); a filter is a mask over the items."""

    def __init__(self, x: torch.Tensor, dtype: torch.dtype):
        self.x = x.to(dtype)
        self.chunk = max(1, (1 << 29) // x.shape[0])

    def search(self, q: torch.Tensor, k: int, mask: torch.Tensor | None) -> torch.Tensor:
        out = []
        for s in range(0, q.shape[0], self.chunk):
            scores = (q[s : s + self.chunk].to(self.x.dtype) @ self.x.T).float()
            if mask is not None:
                scores.masked_fill_(~mask, float("-inf"))
            top, idx = scores.topk(k, dim=1)
            out.append(torch.where(top > float("-inf"), idx, torch.full_like(idx, -1)))
        return torch.cat(out)


SCAN_CASES = ((0, 0, 1, 10), (1, 5, 40, 100), (2, 7, 37, 200), (1, 0, 300, 1000))
"""The kernel check's cases, (filter clauses, excluded rows, queries, best r): r 10 and 100 are
selected in the kernel (``gpu_scan.SELECT_MAX``: 128; lists longer than r), 200 and 1000 come
from full score rows."""
LENGTHS = [0, 5, 300, 1111, 129, 64, 2000, 17]
"""The checked lists' sizes: an empty one, ones shorter and longer than a tile (128 items)."""
SMALL_LENGTHS = [0, 5, 300, 140, 129, 64, 400, 17]
"""The same kinds of lists, shorter: the check off CUDA, under Triton's interpreter."""
SMALL_BATCH = 24
"""The most queries a case takes off CUDA (more than a program's 16: a list's queries chunked)."""


def interpret_off_cuda(device: str) -> None:
    """Off CUDA the kernel runs under Triton's interpreter, which is chosen as ``gpu_scan`` is
    imported (its kernels are decorated then): sets ``TRITON_INTERPRET`` before that, or
    refuses where the module was imported compiled already."""
    if device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "retrieval.index.gpu_scan" in sys.modules:
        raise RuntimeError(f"the kernel check on {device} needs TRITON_INTERPRET=1 before triton")
    os.environ["TRITON_INTERPRET"] = "1"


@contextlib.contextmanager
def scan_kernel(name: str) -> Iterator[None]:
    """Searches inside scan lists with kernel ``name`` (``KERNEL_ENV``: triton or reference)."""
    before = os.environ.get(KERNEL_ENV)
    os.environ[KERNEL_ENV] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ[KERNEL_ENV]
        else:
            os.environ[KERNEL_ENV] = before


def scan_case(
    kind: str, clauses: int, excluded: int, b: int, lengths: list[int], seed: int, device: str
) -> tuple[Lists, ScanRows]:
    """Random scan inputs on ``device`` (as ``tests/retrieval/index/test_gpu_scan.py`` makes
    them): 64-d ``kind`` codes in lists of ``lengths``, ``b`` queries probing 4 lists each (a
    fifth of the slots skipped), ``clauses`` filter clauses over 2 signature words, and
    ``excluded`` rows each query excludes (ascending, the last one PAD; 0: none)."""
    from retrieval.index.codes import quantize
    from retrieval.index.exclude import PAD

    g = torch.Generator().manual_seed(seed)
    n, nlist, d, w = sum(lengths), len(lengths), 64, 2
    codes, scales = quantize(torch.randn(n, d, generator=g), kind)
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()])
    q = torch.randn(b, d, generator=g)
    probes = torch.stack([torch.randperm(nlist, generator=g)[:4] for _ in range(b)])
    probes[torch.rand(b, 4, generator=g) < 0.2] = -1
    coarse = torch.randn(b, 4, generator=g)
    sig = torch.randint(0, 2**62, (n, w), generator=g)
    fmask = torch.randint(0, 2**62, (b, clauses, w), generator=g)
    fmask &= torch.randint(0, 2**62, (b, clauses, w), generator=g)
    fneg = torch.rand(b, clauses, generator=g) < 0.3
    excl = None
    if excluded:
        excl = torch.randint(0, n, (b, excluded), generator=g).sort(dim=1).values
        excl[:, -1] = PAD
        excl = excl.to(device)
    lists = Lists.of(codes.to(device), scales.to(device), offsets.to(device), sig.to(device))
    rows = ScanRows(
        q.to(device), probes.to(device), coarse.to(device), fmask.to(device), fneg.to(device), excl
    )
    return lists, rows


def check_scan(device: str) -> dict:
    """The Triton scan against ``scan_reference`` on ``device``, INT8 and FP8, in each of
    :data:`SCAN_CASES`: the same items pass, their scores agree to float32 rounding and the
    same items come back (ties aside) -> the cases checked by kernel path (``select``: the
    best r picked in the kernel; ``full``: full score rows). Off CUDA, under the interpreter,
    on :data:`SMALL_LENGTHS` and at most :data:`SMALL_BATCH` queries a case."""
    interpret_off_cuda(device)
    from retrieval.index.gpu_scan import kept_per_list, scan_triton

    cuda = device.startswith("cuda")
    lengths = LENGTHS if cuda else SMALL_LENGTHS
    paths = {"select": 0, "full": 0}
    for kind in ("int8", "fp8"):
        for seed, (clauses, excluded, b, r) in enumerate(SCAN_CASES):
            b = b if cuda else min(b, SMALL_BATCH)
            lists, rows = scan_case(kind, clauses, excluded, b, lengths, seed, device)
            rp, rs = scan_reference(lists, rows, r)
            gp, gs = scan_triton(lists, rows, r)
            where = f"{kind}, r {r}"
            assert gp.shape == rp.shape == (b, r) and gs.shape == rs.shape, f"{where}: shapes"
            fin = torch.isfinite(rs)
            assert torch.equal(torch.isfinite(gs), fin), f"{where}: passing items differ"
            torch.testing.assert_close(gs[fin], rs[fin], rtol=1e-5, atol=1e-5)
            same = (gp.unsqueeze(2) == rp.unsqueeze(1)).any(2) | (rp < 0)
            assert float(same.float().mean()) > 0.999, f"{where}: items differ"
            paths["select" if kept_per_list(lists.offsets, r) is not None else "full"] += 1
    assert paths["select"] and paths["full"], f"both kernel paths checked: {paths}"
    return paths


def check_kernel(device: str) -> dict:
    """The kernel check of ``--check``: :func:`check_scan`, then :func:`check_index` (off CUDA,
    under the interpreter, on 5,000 items in 32 lists and 16 queries)."""
    paths = check_scan(device)
    agree = check_index(device) if device.startswith("cuda") else check_index(device, 5000, 32, 16)
    return {"cases": sum(paths.values()), **paths, "index": agree, "ok": True}


def check_index(device: str, n: int = 50_000, nlist: int = 128, b: int = 64) -> float:
    """A filtered search excluding seen items on ``device`` (``n`` items in ``nlist`` lists,
    ``b`` queries): the Triton scan's answers against the same search through
    ``scan_reference`` -> the share of ids they agree on."""
    from retrieval.filters import FilterBatch

    interpret_off_cuda(device)
    d = 64
    x = clustered(n, d, seed=5, device="cpu")
    rng = np.random.default_rng(0)
    attrs = {a: rng.integers(0, v, n) for a, v in VALUES.items()}
    values = {a: [str(i) for i in range(v)] for a, v in VALUES.items()}
    cfg = IVFConfig(nlist=nlist, nprobe=8, rerank=0, exact_copy="none", filter_bound=0.0)
    index = build_ivf(x, cfg, item_attributes=attrs, attribute_values=values).to(device)
    q = clustered(b, d, seed=6, device="cpu").to(device)
    fb = index.compile_filter("a5 in {0,1,2,3} and not a50 = 1", b)
    seen = torch.randint(0, n, (b, 50), generator=torch.Generator().manual_seed(1)).to(device)
    fb = FilterBatch(fb.masks, fb.negate, seen, fb.neg_masks)
    with scan_kernel("triton"):  # on CUDA the default; on the CPU the C++ kernel's otherwise
        got, gs = index.search(q, 100, fb)
    with scan_kernel("reference"):
        want, ws = index.search(q, 100, fb)
    assert not (got.unsqueeze(2) == seen.unsqueeze(1)).any(), "a seen item came back"
    torch.testing.assert_close(gs, ws, rtol=1e-4, atol=1e-4)
    agree = float((got.unsqueeze(2) == want.unsqueeze(1)).any(2).float().mean())
    assert agree > 0.99, f"index answers agree on {agree:.4f} of ids"
    return agree


def build(n: int, d: int, device: str) -> tuple[IVFIndex, torch.Tensor, dict, float]:
    """The index (built on the CPU, moved to ``device``), the vectors on ``device``, the
    attribute columns, and the build seconds."""
    gen_dev = device if device.startswith("cuda") else "cpu"
    x = clustered(n, d, seed=1, device=gen_dev)
    rng = np.random.default_rng(2)
    attrs = {a: rng.integers(0, v, n) for a, v in VALUES.items()}
    values = {a: [str(i) for i in range(v)] for a, v in VALUES.items()}
    nlist = 1 << round(math.log2(max(1.0, math.sqrt(n))))
    cfg = IVFConfig(
        nlist=nlist, nprobe=32, codes="int8", rerank=0, exact_copy="none", filter_bound=0.0
    )
    t0 = time.perf_counter()
    index = build_ivf(x.cpu(), cfg, item_attributes=attrs, attribute_values=values)
    seconds = time.perf_counter() - t0
    return index.to(device), x, attrs, seconds


def run_size(n: int, args: argparse.Namespace) -> dict:
    dev, d = args.device, args.dim
    index, x, attrs, build_s = build(n, d, dev)
    print(f"[{n:,}] built in {build_s:.1f}s: nlist {index.nlist}, max list {index.max_list}")
    mem = index.memory_bytes()
    batches, ks = ints(args.batches), ints(args.ks)
    qn = max(batches)
    q = clustered(qn, d, seed=3, device=x.device.type).to(dev)
    masks = {
        s: None if f is None else torch.from_numpy(attrs[f.split()[0]] == 0).to(x.device)
        for s, f in FILTERS.items()
        if s in [float(v) for v in args.selectivities.split(",")]
    }
    exact = Brute(x, torch.float32)
    truth = {(s, k): exact.search(q, k, m) for s, m in masks.items() for k in ks}
    # nprobe: the smallest reaching the target recall@100 unfiltered
    chosen, sweep = None, []
    for nprobe in ints(args.nprobes):
        ids, _ = index.search(q, 100, nprobe=nprobe)
        rec = recall(
            ids.to(x.device), truth[(1.0, 100)] if 100 in ks else exact.search(q, 100, None)
        )
        sweep.append({"nprobe": nprobe, "recall@100": rec})
        print(f"[{n:,}] nprobe {nprobe}: recall@100 {rec:.4f}")
        if rec >= args.target:
            chosen = nprobe
            break
    chosen = chosen or ints(args.nprobes)[-1]
    if args.profile is not None:
        profile(index, q, chosen, batches, args.profile.with_suffix(f".{n}.txt"))
    brute = None if args.no_brute or not dev.startswith("cuda") else Brute(x, torch.float16)
    rows = []
    for sel, mask in masks.items():
        text = FILTERS[sel]
        for k in ks:
            for b in batches:
                qb = q[:b]
                row: dict = {"n": n, "selectivity": sel, "k": k, "batch": b}
                found: list[torch.Tensor] = []

                def ours(qb=qb, k=k, text=text, found=found) -> None:
                    ids, _ = index.search(qb, k, text, nprobe=chosen)
                    found.append(ids)

                row["ours"] = summary(time_calls(ours, dev, args.budget_s), b)
                if b == qn:
                    row["ours"]["recall"] = recall(found[0].to(x.device), truth[(sel, k)])
                if brute is not None:
                    out: list[torch.Tensor] = []

                    def flat(qb=qb, k=k, mask=mask, out=out) -> None:
                        out.append(brute.search(qb, k, mask))

                    row["brute"] = summary(time_calls(flat, dev, args.budget_s), b)
                    if b == qn:
                        row["brute"]["recall"] = recall(out[0], truth[(sel, k)])
                    row["speedup"] = row["ours"]["qps"] / row["brute"]["qps"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return {
        "n": n,
        "nlist": index.nlist,
        "nprobe": chosen,
        "sweep": sweep,
        "build_s": build_s,
        "bytes_per_item": sum(mem.values()) / n,
        "bytes": mem,
        "rows": rows,
    }


def profile(index: IVFIndex, q: torch.Tensor, nprobe: int, batches: list[int], path: Path) -> None:
    """torch.profiler tables (by device time, by host time) of 20 unfiltered searches at the
    smallest and largest batch: where a search's time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU]
    if q.device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    parts = []
    for b in (min(batches), max(batches)):
        for _ in range(3):
            index.search(q[:b], 100, nprobe=nprobe)
        with torch_profile(activities=acts) as prof:
            for _ in range(20):
                index.search(q[:b], 100, nprobe=nprobe)
            sync(q.device.type)
        table = prof.key_averages()
        for key in ("self_device_time_total", "self_cpu_time_total"):
            if key == "self_device_time_total" and q.device.type != "cuda":
                continue
            parts.append(
                f"## batch {b}, 20 searches, by {key}\n{table.table(sort_by=key, row_limit=25)}"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(parts))
    print(f"wrote {path}", flush=True)


def render(report: dict) -> str:
    """Markdown tables of a report (``--render``): per size, q/s and p50 of ours and of the
    GEMM + topk baseline, their ratio, and recall at the largest batch."""
    out = [f"{report['device']}, torch {report['torch']}, {report['cpu_threads']} CPU threads"]
    for s in report["sizes"]:
        sweep = ", ".join(f"{x['nprobe']}: {x['recall@100']:.3f}" for x in s["sweep"])
        out += [
            "",
            f"**{s['n']:,} items** x {report['args']['dim']}: nlist {s['nlist']}, nprobe "
            f"{s['nprobe']} (recall@100 by nprobe: {sweep}); {s['bytes_per_item']:.1f} bytes "
            f"per item on the GPU; built in {s['build_s']:.0f} s on the CPU",
            "",
            "| filter passes | K | batch | ours q/s | ours p50 / p99 ms | GEMM+topk q/s "
            "| GEMM+topk p50 ms | ours / GEMM | recall ours / GEMM (fp16) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in s["rows"]:
            o, b = r["ours"], r.get("brute", {})
            rec = (
                f"{o['recall']:.3f} / {b.get('recall', float('nan')):.3f}" if "recall" in o else ""
            )
            out.append(
                f"| {r['selectivity']:.1%} | {r['k']} | {r['batch']} | {o['qps']:,.0f} "
                f"| {o['p50_ms']:.2f} / {o['p99_ms']:.2f} | {b.get('qps', 0):,.0f} "
                f"| {b.get('p50_ms', 0):.2f} | {r.get('speedup', 0):.2f}x | {rec} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--render":
        print(render(json.loads(Path(sys.argv[2]).read_text())))
        return
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu.py: --device cuda, but torch sees no CUDA device")
    report: dict = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if args.check:
        report["check"] = check_kernel(args.device)
        print("kernel check:", report["check"], flush=True)
    report["sizes"] = []
    for n in ints(args.sizes):
        report["sizes"].append(run_size(n, args))
        if args.out is not None:  # after every size: a later one that fails keeps these
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
            print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
