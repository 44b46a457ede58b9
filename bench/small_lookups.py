"""Serving-size table lookups in one process: what one request's tables cost, by part.

Two cases, timed against the code on ``PYTHONPATH`` (run it from two checkouts in turns for an
A/B), medians over many calls, nothing loaded that a server does not load (no ``torch._dynamo``):

* ``padded``: ``LocalTables.forward_padded`` (the host tier's fbgemm call and its glue) on one
  request: 3 one-id features and a 50-id history (``-1`` padded), FP32, mean pooling;
* ``hot``: the bench model (``bench/bench_model.py``, ``--items``, untrained: latency only) with
  its item table remote and read through its hot-row cache at the default size (never copied
  whole, ``bench/remote_hot.py``'s plan), an in-process fetcher standing in for the embedding
  server (no RPC): the tables call and the whole forward per request (one user, users drawn
  uniformly), after ``--warm`` requests fill the cache; beside the same model all local.

Run from the repository root::

    .venv/bin/python bench/small_lookups.py
    (cd /tmp/old && PYTHONPATH=$PWD /work/main/.venv/bin/python bench/small_lookups.py)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_model import trained_model

from retrieval.model import table_specs
from retrieval.tiering import tier_model
from sharded_tables.planner import Budgets, plan
from sharded_tables.specs import DType, Tier
from sharded_tables.tbe import LocalTable, LocalTables


class InProcessServers:
    """The embedding servers' answer without the RPC: packed rows by table."""

    def __init__(self, packed: Mapping[str, torch.Tensor]):
        self.packed = dict(packed)

    def fetch(
        self, ids_by_table: Mapping[str, torch.Tensor], timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        return {t: self.packed[t][ids] for t, ids in ids_by_table.items()}


def median_us(fn: Callable[[Any], object], inputs: Sequence[Any]) -> float:
    lat = []
    for x in inputs:
        t0 = time.perf_counter()
        fn(x)
        lat.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(lat)


def padded_case(calls: int) -> dict[str, float]:
    tables = [LocalTable(f"t{i}", 1000, 32, DType.FP32, (f"f{i}",), "mean") for i in range(4)]
    module = LocalTables(tables, tier="host", device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    requests = [
        [torch.randint(0, 1000, (1, 1), generator=g) for _ in range(3)]
        + [torch.randint(-1, 1000, (1, 50), generator=g)]
        for _ in range(calls)
    ]
    with torch.inference_mode():
        for r in requests[:200]:
            module.forward_padded(r)
        return {"forward_padded_us": median_us(module.forward_padded, requests)}


def hot_case(items: int, warm: int, calls: int) -> dict[str, float]:
    prep, model = trained_model(2000, items, 0)
    specs = table_specs(model.config, DType.FP32)
    item = next(s for s in specs if s.name == "item")
    rest = sum(s.bytes(DType.FP32) for s in specs if s is not item)
    budgets = Budgets(
        device=0,
        host=rest + 4096,
        remote_per_server=2 * item.bytes(DType.FP32),
        remote_servers=1,
        cache=item.bytes(DType.FP32),
        cache_whole_max=0,
    )
    placement = plan(specs, budgets)
    assert placement.placement("item").tier is Tier.REMOTE
    hot, rows = tier_model(model, placement=placement)
    hot.tables.remote = InProcessServers(rows)  # type: ignore[attr-defined]
    users = np.random.default_rng(0).integers(0, 2000, warm + calls)
    batches = [prep.user_batch(users[i : i + 1]) for i in range(len(users))]
    sparse = [model.user_sparse(b) for b in batches]
    out: dict[str, float] = {"cache_rows": placement.placement("item").cache_rows}
    with torch.inference_mode():
        for s, b in zip(sparse[:warm], batches[:warm], strict=True):
            hot.tables(s)
            hot(b, 100)
            model(b, 100)
        out["hot_tables_us"] = median_us(hot.tables, sparse[warm:])
        out["local_tables_us"] = median_us(model.tables, sparse[warm:])
        out["hot_forward_us"] = median_us(lambda b: hot(b, 100), batches[warm:])
        out["local_forward_us"] = median_us(lambda b: model(b, 100), batches[warm:])
    out["dynamo_loaded"] = float("torch._dynamo" in sys.modules)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--warm", type=int, default=1500, help="untimed requests first (fill the cache)")
    p.add_argument("--calls", type=int, default=1000, help="timed requests per case")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {**padded_case(args.calls * 3), **hot_case(args.items, args.warm, args.calls)}
    print(" ".join(f"{k}={v:.1f}" for k, v in results.items()), flush=True)


if __name__ == "__main__":
    main()
