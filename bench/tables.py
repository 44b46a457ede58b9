"""Embedding-table benchmark: our tiers against raw fbgemm TBE and ``nn.EmbeddingBag``, one run.

8 tables x 1M rows x 64 dims (``--small``: 8 x 100k), a batch of ``--batch`` samples with
``--pooling`` ids per table per sample, ids uniform or Zipf(1.1). For each dtype:

* ``nn.EmbeddingBag`` FP32 sum pooling, one module per table (the baseline every ratio divides by);
* raw fbgemm ``IntNBitTableBatchedEmbeddingBagsCodegen``, jagged ids prepared outside the timer;
* ours: ``TieredEmbeddingCollection.forward`` from padded id matrices (the towers' call), so the
  jagged conversion and mean pooling count as our overhead;
* remote: the same tables on 2 embedding-server processes on 127.0.0.1, without a cache and
  with a warm hot-row cache (Zipf ids; ``--cache-fractions`` of rows), latency vs local, per batch and per request.

Run from the repository root::

    .venv/bin/python bench/tables.py --small          # ~1 min
    .venv/bin/python bench/tables.py                  # 8 x 1M x 64, ~5 min on 2 cores

Writes ``--out`` (JSON) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import process
from sharded_tables.planner import Budgets, PlacementPlan, TablePlacement
from sharded_tables.quantize import pack_rows
from sharded_tables.specs import DType, TableSpec, Tier, row_bytes
from sharded_tables.tbe import fbgemm_has_cuda, jagged_from_padded
from sharded_tables.tiered import TieredEmbeddingCollection

DTYPES = [DType.FP32, DType.FP16, DType.FP8, DType.INT8, DType.INT4]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="8 x 100k rows (quick check)")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, help="rows per table (default 1M, 100k with --small)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512, help="samples per lookup call")
    p.add_argument("--pooling", type=int, default=20, help="ids per table per sample")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per case (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--cache-fractions",
        default="0.05,0.25",
        help="hot-row cache sizes to try, as shares of a remote table's rows (0 always runs)",
    )
    p.add_argument(
        "--request-users", type=int, default=8, help="users in one request (latency regime)"
    )
    p.add_argument("--no-remote", action="store_true", help="skip the embedding-server cases")
    p.add_argument("--remote-only", action="store_true", help="only the embedding-server cases")
    p.add_argument("--device", default="cpu", help="cpu or cuda (remote cases run on cpu only)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def make_ids(
    dist: str, rows: int, shape: tuple[int, int], seed: int, table: int = 0
) -> torch.Tensor:
    """``[B, L]`` int64 ids: uniform, or Zipf(1.1) over a permutation of the rows that depends
    only on ``table`` (so every batch of a table shares its hot rows)."""
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        return torch.from_numpy(rng.integers(0, rows, shape))
    ranks = rng.zipf(1.1, size=shape)
    ranks = np.where(ranks > rows, rng.integers(1, rows + 1, shape), ranks) - 1
    perm = np.random.default_rng(10_000 + table).permutation(rows)
    return torch.from_numpy(perm[ranks])


def median_ms_each(fn: Callable[[object], object], inputs: list) -> float:
    """Median ms of ``fn(x)`` over ``inputs``, each a fresh batch (after 2 warm-up calls on the
    last input): no batch is timed twice, so no cache -- ours or the CPU's -- sees it again."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn(inputs[-1])
    fn(inputs[-1])
    sync()
    runs = []
    for x in inputs[:-1]:
        t0 = time.perf_counter()
        fn(x)
        sync()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e3


def batches(
    dist: str, names: list[str], rows: int, shape: tuple[int, int], count: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    """``count`` batches ``{table: ids [B, L]}`` from one distribution, different samples."""
    return [
        {
            n: make_ids(dist, rows, shape, seed=seed + 1000 * k + i, table=i)
            for i, n in enumerate(names)
        }
        for k in range(count)
    ]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    fn()
    sync()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e3


def plan_for(
    specs: list[TableSpec], tier: Tier, servers: int = 0, cache_rows: int = 0
) -> PlacementPlan:
    """Every table in ``tier`` (remote: rows split evenly over ``servers``), budgets unbounded."""
    placements = []
    for s in specs:
        if tier is Tier.REMOTE:
            bounds = tuple(int(x) for x in np.linspace(0, s.rows, servers + 1).round())
            placements.append(
                TablePlacement(
                    s.name,
                    tier,
                    s.dtype,
                    s.bytes(),
                    servers=tuple(range(servers)),
                    partition="range",
                    row_bounds=bounds,
                    cache_rows=cache_rows,
                )
            )
        else:
            placements.append(TablePlacement(s.name, tier, s.dtype, s.bytes()))
    big = 1 << 50
    return PlacementPlan(
        tuple(placements),
        Budgets(
            device=big, host=big, remote_per_server=big if servers else 0, remote_servers=servers
        ),
    )


def raw_tbe(specs: list[TableSpec], packed: list[torch.Tensor], device: torch.device):
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

    location = EmbeddingLocation.HOST if device.type == "cpu" else EmbeddingLocation.DEVICE
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        [(s.name, s.rows, s.dim, SparseType(s.dtype.value), location) for s in specs],
        pooling_mode=PoolingMode.SUM,
        device=device,
        bounds_check_mode=BoundsCheckMode.NONE,
        output_dtype=SparseType.FP32,
        fp8_exponent_bits=4,
        fp8_exponent_bias=7,
        indices_dtype=torch.int64,
    )
    tbe.initialize_weights()
    for (w, sb), p in zip(tbe.split_embedding_weights(), packed, strict=True):
        if sb is None:
            w.copy_(p)
        else:
            sb.copy_(p[:, :4])
            w.copy_(p[:, 4:])
    return tbe


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = args.rows or (100_000 if args.small else 1_000_000)
    t, d, b, per = args.tables, args.dim, args.batch, args.pooling
    print(
        f"{t} tables x {rows:,} rows x {d} dims; batch {b} x {per} ids/table ({b * per * t:,} ids)"
    )
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(rows, d, generator=g) * 0.05 for _ in range(t)]
    names = [f"t{i}" for i in range(t)]
    results: dict = {
        "config": {**vars(args), "rows": rows, "out": str(args.out)},
        "machine": {
            "cpu": platform.processor(),
            "threads": args.threads,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "torch": torch.__version__,
        },
        "cases": [],
    }

    def record(case: dict) -> None:
        results["cases"].append(case)
        print(json.dumps(case))

    device = torch.device(args.device)
    count = args.repeats + 1
    for dist in () if args.remote_only else ("uniform", "zipf"):
        inputs = [
            {n: x.to(device) for n, x in batch.items()}
            for batch in batches(dist, names, rows, (b, per), count, seed=0)
        ]
        jagged = [jagged_from_padded([x[n] for n in names])[:2] for x in inputs]
        ids = b * per * t
        # baseline: nn.EmbeddingBag FP32, one per table
        bags = [torch.nn.EmbeddingBag.from_pretrained(w, mode="sum").to(device) for w in weights]
        base_ms = median_ms_each(
            lambda f, bags=bags: [bag(f[n]) for bag, n in zip(bags, names, strict=True)], inputs
        )
        base = {"dist": dist, "device": device.type, "ids": ids}
        record(
            {
                **base,
                "system": "nn.EmbeddingBag",
                "dtype": "fp32",
                "tier": "device" if device.type == "cuda" else "host",
                "ms": base_ms,
                "lookups_per_s": ids / base_ms * 1e3,
                "bytes_per_row": row_bytes(d, DType.FP32),
                "ratio_vs_embeddingbag": 1.0,
            }
        )
        del bags
        for dtype in DTYPES:
            specs = [
                TableSpec(n, rows, d, dtype=dtype, pooling="sum", features=(n,)) for n in names
            ]
            timed: list[tuple[str, str, float]] = []
            raw_ms = None
            if device.type == "cpu" or fbgemm_has_cuda():
                tbe = raw_tbe(specs, [pack_rows(w, dtype) for w in weights], device)
                raw_ms = median_ms_each(lambda j, m=tbe: m(*j), jagged)
                tier_name = "device" if device.type == "cuda" else "host"
                timed.append(("fbgemm TBE (raw)", tier_name, raw_ms))
                del tbe
            for tier in [Tier.DEVICE, Tier.HOST] if device.type == "cuda" else [Tier.HOST]:
                ours = TieredEmbeddingCollection(specs, plan_for(specs, tier), device=device)
                ours.load_float(dict(zip(names, weights, strict=True)))
                backend = next(iter(ours.tiers.values())).backend
                ms = median_ms_each(lambda f, m=ours: m(f), inputs)
                timed.append((f"ours {tier.value} tier ({backend}), padded ids", tier.value, ms))
                ms = median_ms_each(lambda j, m=ours: m.forward_jagged(names, *j), jagged)
                timed.append((f"ours {tier.value} tier ({backend}), jagged ids", tier.value, ms))
                del ours
            for system, tier_name, ms in timed:
                case = {
                    **base,
                    "system": system,
                    "dtype": dtype.value,
                    "tier": tier_name,
                    "ms": ms,
                    "lookups_per_s": ids / ms * 1e3,
                    "bytes_per_row": row_bytes(d, dtype),
                    "ratio_vs_embeddingbag": base_ms / ms,
                }
                if raw_ms is not None:
                    case["overhead_vs_raw"] = ms / raw_ms - 1.0
                record(case)
    if not args.no_remote and device.type == "cpu":
        remote_cases(args, names, weights, rows, record)
    render(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")


def remote_cases(args, names, weights, rows, record) -> None:
    """INT8 tables on 2 embedding servers: no cache vs warm cache, vs the local host tier."""
    from sharded_tables.export import remote_routing, write_server_folders
    from sharded_tables.remote.client import RemoteTables

    dtype, d, b, per, t = DType.INT8, args.dim, args.batch, args.pooling, args.tables
    specs = [TableSpec(n, rows, d, dtype=dtype, pooling="sum", features=(n,)) for n in names]
    servers = 2
    with tempfile.TemporaryDirectory() as tmp:
        base = plan_for(specs, Tier.REMOTE, servers)
        scratch = TieredEmbeddingCollection(specs, base)
        packed = scratch.load_float(dict(zip(names, weights, strict=True)))
        folders = write_server_folders(base, specs, packed, Path(tmp))
        del scratch, packed
        procs, addrs = [], []
        try:
            for i in sorted(folders):
                proc = process.start(
                    [
                        sys.executable,
                        "-m",
                        "recserve",
                        "serve",
                        "embeddings",
                        "--folder",
                        str(folders[i]),
                        "--grpc-port",
                        "0",
                        "--memory-budget",
                        "64GiB",
                    ],
                    log_path=Path(tmp) / f"embed-{i}.log",
                )
                procs.append(proc)
                addrs.append(proc.wait_ready(60.0).grpc)
            local = TieredEmbeddingCollection(specs, plan_for(specs, Tier.HOST))
            local.load_float(dict(zip(names, weights, strict=True)))
            count = args.repeats + 1
            for dist in ("uniform", "zipf"):
                # a served batch (--batch users) and one request (--request-users users)
                for users in (b, args.request_users):
                    timed = batches(dist, names, rows, (users, per), count, seed=7)
                    warm = batches(dist, names, rows, (users, per), 30, seed=50_000)
                    local_ms = median_ms_each(lambda f: local(f), timed)
                    fractions = [0.0] + [float(x) for x in args.cache_fractions.split(",") if x]
                    for cache_fraction in fractions:
                        cache_rows = int(rows * cache_fraction)
                        placement = plan_for(specs, Tier.REMOTE, servers, cache_rows)
                        client = RemoteTables(remote_routing(placement, specs, addrs), timeout=30.0)
                        coll = TieredEmbeddingCollection(
                            specs, placement, remote=client, timeout=30.0
                        )
                        for f in warm:  # other samples of the same distribution
                            coll(f)
                        check = coll(timed[0])
                        want = local(timed[0])
                        for n in names:
                            torch.testing.assert_close(check[n], want[n])
                        before = _hits_misses(coll)
                        ms = median_ms_each(lambda f, c=coll: c(f), timed)
                        after = _hits_misses(coll)
                        hits = after[0] - before[0]
                        looked_up = hits + after[1] - before[1]
                        record(
                            {
                                "dist": dist,
                                "system": f"ours remote tier ({servers} servers), {users} users",
                                "dtype": dtype.value,
                                "tier": "remote",
                                "users": users,
                                "cache_fraction": cache_fraction,
                                "ms": ms,
                                "lookups_per_s": users * per * t / ms * 1e3,
                                "local_ms": local_ms,
                                "latency_vs_local": ms / local_ms,
                                "cache_hit_rate": hits / max(looked_up, 1),
                                "bytes_per_row": row_bytes(d, dtype),
                            }
                        )
                        client.close()
        finally:
            process.stop_all(procs, timeout_s=10.0)


def _hits_misses(coll: TieredEmbeddingCollection) -> tuple[int, int]:
    """Cache hits and misses so far, summed over tables (per id looked up)."""
    stats = coll.cache_stats().values()
    return int(sum(s["hits"] for s in stats)), int(sum(s["misses"] for s in stats))


def render(results: dict) -> None:
    print(
        "\n| ids | system | dtype | bytes/row | ms/batch | M lookups/s | × EmbeddingBag | "
        "overhead vs raw | remote vs local | cache hit rate |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in results["cases"]:
        print(
            f"| {c['dist']} | {c['system']}"
            + (f" cache {c['cache_fraction']:.0%}" if "cache_fraction" in c else "")
            + f" | {c['dtype']} | {c.get('bytes_per_row', '')} | {c['ms']:.2f} | "
            f"{c['lookups_per_s'] / 1e6:.1f} | "
            + (f"{c['ratio_vs_embeddingbag']:.2f}" if "ratio_vs_embeddingbag" in c else "")
            + " | "
            + (f"{c['overhead_vs_raw']:+.1%}" if "overhead_vs_raw" in c else "")
            + " | "
            + (f"{c['latency_vs_local']:.2f}" if "latency_vs_local" in c else "")
            + " | "
            + (f"{c['cache_hit_rate']:.2f}" if "cache_hit_rate" in c else "")
            + " |"
        )


if __name__ == "__main__":
    main()
