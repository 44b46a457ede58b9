"""The index's device path on a GPU: the host-planned search vs the device path (the plan decided
on the device, fixed shapes: ``retrieval/index/device_search.py``), eager and replayed from one
CUDA graph per batch bucket, vs exact search as one GEMM + ``torch.topk`` on the same GPU.

One IVF index (``bench/gpu.py``'s: clustered vectors, INT8 codes, no exact copy), and for each
filter (by selectivity) and batch (up to ``cuda_graphs.MAX_BATCH``, the largest a graph
records): p50 / p99 per batch and q/s of each system, timed in turns (``--rounds``), recall@K of
each against exact float search, the share of the device path's ids equal to the host path's,
and the device path's p50 over the host path's (and over GEMM + topk) per round, then their
median. On the CPU there is no graph: the "graphed" system is then the eager one (a smoke run).

    python bench/gpu_device_path.py --device cuda --out gpu_device.json      # a GPU machine
    python bench/gpu_device_path.py --device cpu --size 20000 --batches 1,4  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu  # bench/gpu.py: the index, the vectors, the timers, the GEMM + topk baseline

from retrieval.index.cuda_graphs import GRAPHS_ENV, MAX_BATCH

SYSTEMS = ("host", "device", "device_graphed")
"""The host-planned rounds (a plain first round from its CUDA graph, as served); the device path
eager; the device path from CUDA graphs."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    p.add_argument("--size", type=int, default=1_000_000, help="items in the catalog")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batches", default="1,16,32", help=f"batch sizes (at most {MAX_BATCH})")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--selectivities", default="1,0.05", help="filters by selectivity (gpu.py's)")
    p.add_argument("--rounds", type=int, default=2, help="turns of the systems, timed in turn")
    p.add_argument("--budget-s", type=float, default=0.2, help="seconds of timed runs per cell")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def machine(device: str) -> dict:
    """What ran it: the GPU's name (or the CPU's), torch and the core count."""
    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.machine()
    return {"device": device, "name": name, "torch": torch.__version__, "cores": os.cpu_count()}


def run_cell(index, q, k: int, text: str | None, truth: torch.Tensor, args) -> dict:
    """One (filter, batch) cell: every system timed in turns, their recall and agreement."""
    b = q.shape[0]
    fb = index.compile_filter(text, b) if text is not None else None

    def search(system: str):
        index.executor.backend = "auto" if system == "host" else "device"
        os.environ.pop(GRAPHS_ENV, None)  # the host path graphs its plain first rounds, as served
        if system == "device":
            os.environ[GRAPHS_ENV] = "0"
        return lambda: index.search(q, k, fb)

    found = {s: search(s)()[0] for s in SYSTEMS}
    runs: dict[str, list[list[float]]] = {s: [] for s in SYSTEMS}
    for _ in range(args.rounds):
        for s in SYSTEMS:
            runs[s].append(gpu.time_calls(search(s), args.device, args.budget_s))
    index.executor.backend = "auto"
    os.environ.pop(GRAPHS_ENV, None)
    row: dict = {"batch": b}
    for s in SYSTEMS:
        row[s] = gpu.summary([t for r in runs[s] for t in r], b)
        row[s]["recall"] = gpu.recall(found[s], truth)
    row["same_ids"] = float((found["device"] == found["host"]).float().mean())
    row["same_ids_graphed"] = float((found["device_graphed"] == found["device"]).float().mean())
    p50 = {s: [statistics.median(r) for r in runs[s]] for s in SYSTEMS}
    row["graphed_over_host"] = statistics.median(
        g / h for g, h in zip(p50["device_graphed"], p50["host"], strict=True)
    )
    row["eager_over_host"] = statistics.median(
        e / h for e, h in zip(p50["device"], p50["host"], strict=True)
    )
    return row


def gemm_runs(brute, q: torch.Tensor, k: int, mask: torch.Tensor | None, args) -> list[float]:
    """Seconds per call of exact search as GEMM + topk (``gpu.Brute``)."""
    return gpu.time_calls(lambda: brute.search(q, k, mask), args.device, args.budget_s)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    batches = gpu.ints(args.batches)
    if max(batches) > MAX_BATCH:
        raise SystemExit(f"--batches: at most {MAX_BATCH} (the largest batch a graph records)")
    index, x, attrs, build_s = gpu.build(args.size, args.dim, args.device)
    q = gpu.clustered(max(batches), args.dim, seed=9, device=x.device.type)
    brute = gpu.Brute(x, torch.float16 if args.device.startswith("cuda") else torch.float32)
    report: dict = {"machine": machine(args.device), "size": args.size, "dim": args.dim}
    report |= {"k": args.k, "build_s": build_s, "nprobe": index.config.nprobe, "cells": []}
    for sel in (float(s) for s in args.selectivities.split(",")):
        text = gpu.FILTERS[sel]
        mask = None
        if text is not None:
            attr = text.split(" ")[0]
            mask = torch.from_numpy(attrs[attr] == 0).to(x.device)
        for b in batches:
            qb = q[:b]
            truth = brute.search(qb, args.k, mask)
            gemm = gpu.summary(gemm_runs(brute, qb, args.k, mask, args), b)
            row = run_cell(index, qb, args.k, text, truth, args)
            row |= {"selectivity": sel, "gemm_topk": gemm}
            row["graphed_over_gemm"] = row["device_graphed"]["p50_ms"] / gemm["p50_ms"]
            report["cells"].append(row)
            print(
                f"sel {sel:<6} B {b:<3} p50 ms: host {row['host']['p50_ms']:.3f} device "
                f"{row['device']['p50_ms']:.3f} graphed {row['device_graphed']['p50_ms']:.3f} "
                f"gemm+topk {gemm['p50_ms']:.3f} | graphed/host {row['graphed_over_host']:.2f} "
                f"| recall host {row['host']['recall']:.3f} device {row['device']['recall']:.3f} "
                f"| same ids {row['same_ids']:.3f}",
                flush=True,
            )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
