"""The host tier's device cache (``sharded_tables/device_cache.py``): hit rate and time per
batch of one table's lookups, uncached against cached, in one run on one device.

One table (``--rows`` x ``--dim`` at ``--dtype``, default 1M x 64 INT8: 68 MB of packed rows),
batches of ``--batch`` samples x ``--ids`` ids drawn from truncated Zipf(``--zipf``)
(``bench/zipf_ids.py``), the same batches for every variant:

* ``device``: the whole table in the device tier (on a CPU: the host copy; the reference);
* ``host``: the host tier uncached (on CUDA: pinned memory, the rows copied up through the host);
* ``host+cache``: the host tier with ``--cache-fraction`` of the rows in a device cache,
  ``admit_cached()`` after each batch (timed with it);
* ``host+cache graphed`` (CUDA only): the cached lookup recorded once as a CUDA graph, then
  replayed per batch, ``admit_cached()`` between replays.

Reports per variant the median ms per batch (CUDA timings synchronise after each batch) and
for the cached ones the hit rate over the measured batches (after ``--warm`` batches that fill
the cache), with each variant's time against ``host``'s. On a CPU the cache is a second host
copy: its hit rate is what the policy catches, its time only the bookkeeping's cost.

Run from the repository root::

    .venv/bin/python bench/host_cache.py --small               # CPU, 100k rows, seconds
    python3 bench/host_cache.py --device cuda --out gpu_host_cache.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zipf_ids import ZipfIds  # noqa: E402

from sharded_tables.specs import DType  # noqa: E402
from sharded_tables.tbe import LocalTable, LocalTables  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="100k rows, fewer batches")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--rows", type=int, help="table rows (default 1M; 100k with --small)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", default="int8", choices=[d.value for d in DType])
    p.add_argument("--cache-fraction", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=256, help="samples a batch")
    p.add_argument("--ids", type=int, default=50, help="ids a sample (a history's length)")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--warm", type=int, help="untimed batches first (default 50; 20)")
    p.add_argument("--batches", type=int, help="timed batches (default 200; 50)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="JSON results (default: printed only)")
    args = p.parse_args(argv)
    args.rows = args.rows or (100_000 if args.small else 1_000_000)
    args.warm = args.warm if args.warm is not None else (20 if args.small else 50)
    args.batches = args.batches or (50 if args.small else 200)
    return args


def tables(args: argparse.Namespace, tier: str, cache_rows: int) -> LocalTables:
    """The one table on ``args.device`` in ``tier`` (torch backend), seeded rows."""
    t = LocalTable("t", args.rows, args.dim, DType(args.dtype), ("f",), "sum", cache_rows)
    module = LocalTables([t], tier=tier, device=args.device, backend="torch")
    module.set_float(
        "t", torch.randn(args.rows, args.dim, generator=torch.Generator().manual_seed(0))
    )
    return module


def timed(
    run: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor], device: str
) -> tuple[list[float], list[torch.Tensor]]:
    """ms of each ``run(ids)`` (synchronised on CUDA) and its outputs on the host."""
    ms, outs = [], []
    for ids in batches:
        t0 = time.perf_counter()
        out = run(ids)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
        outs.append(out.cpu())
    return ms, outs


def cached_run(module: LocalTables) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(ids: torch.Tensor) -> torch.Tensor:
        out = module.forward_padded([ids])
        module.admit_cached()
        return out

    return run


def graphed_run(
    module: LocalTables, example: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cached lookup as one CUDA graph over a static id buffer; admissions between replays."""
    static = example.clone()
    module.forward_padded([static])  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module.forward_padded([static])

    def run(ids: torch.Tensor) -> torch.Tensor:
        static.copy_(ids, non_blocking=True)
        graph.replay()
        module.admit_cached()
        return out.clone()

    return run


def hit_rate(module: LocalTables, before: dict[str, float]) -> float:
    (after,) = module.cache_stats().values()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    return hits / (hits + misses) if hits + misses else 0.0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    zipf = ZipfIds(args.rows, args.zipf, table_seed=1)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.ids)
    warm = [zipf.draw(shape, rng).to(args.device) for _ in range(args.warm)]
    batches = [zipf.draw(shape, rng).to(args.device) for _ in range(args.batches)]
    cache_rows = int(args.rows * args.cache_fraction)
    results: dict[str, dict[str, float]] = {}
    reference: list[torch.Tensor] = []
    variants: list[tuple[str, str, int, bool]] = [
        ("device", "device", 0, False),
        ("host", "host", 0, False),
        ("host+cache", "host", cache_rows, False),
    ]
    if args.device.startswith("cuda"):
        variants.append(("host+cache graphed", "host", cache_rows, True))
    with torch.inference_mode():
        for name, tier, rows, graphed in variants:
            module = tables(args, tier, rows)
            run = cached_run(module) if rows else (lambda ids, m=module: m.forward_padded([ids]))
            if graphed:
                run = graphed_run(module, warm[0])
            timed(run, warm, args.device)
            before = dict(next(iter(module.cache_stats().values()), {"hits": 0, "misses": 0}))
            ms, outs = timed(run, batches, args.device)
            if not reference:
                reference = outs
            equal = all(
                torch.allclose(a, b, atol=1e-4) for a, b in zip(outs, reference, strict=True)
            )
            results[name] = {"median_ms": statistics.median(ms), "equal_to_device": equal}
            if rows:
                results[name]["hit_rate"] = hit_rate(module, before)
                results[name]["cache_rows"] = module.cache_stats()[f"host/{args.dtype}/{args.dim}"][
                    "capacity"
                ]
            del module
    host = results["host"]["median_ms"]
    for r in results.values():
        r["vs_host"] = r["median_ms"] / host
    out = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "top_share": zipf.top_share(cache_rows),
        "results": results,
    }
    print("| variant | ms / batch | / host | hit rate | equal |\n|---|---|---|---|---|")
    for name, r in results.items():
        hr = f"{r['hit_rate']:.1%}" if "hit_rate" in r else "—"
        print(
            f"| {name} | {r['median_ms']:.3f} | {r['vs_host']:.2f} | {hr} | {r['equal_to_device']} |"
        )
    print(f"a cache of the {cache_rows:,} hottest rows would catch {out['top_share']:.1%}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
