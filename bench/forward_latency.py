"""One served request's forward, MovieLens 100k shape: p50 of ``model(batch of 1, K)`` with and
without the user's full seen list, 1 thread, the model as `recserve train` builds it (weights
untrained: time does not depend on them).

Compare two checkouts by running this file from each (``PYTHONPATH`` set to the checkout, so its
own ``retrieval`` is imported)::

    PYTHONPATH=. .venv/bin/python bench/forward_latency.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from retrieval.data import load_movielens
from retrieval.model import RetrievalModel
from retrieval.training.prepare import prepare


def p50_ms(model: RetrievalModel, batches: list, k: int) -> float:
    times = []
    for b in batches:
        t0 = time.perf_counter()
        model(b, k)
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data-dir", type=Path, default=Path("data/ml-100k"))
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ds = load_movielens(args.data_dir)
    prep = prepare(ds)
    model = RetrievalModel(prep.config).eval()
    model.build_index(prep.train.item_features, ds.item_attributes, prep.tune_batch())
    users = np.arange(min(args.users, ds.num_users))
    with_seen = [prep.user_batch(np.array([u]), seen=prep.seen) for u in users]
    window = [prep.user_batch(np.array([u])) for u in users]
    with torch.inference_mode():
        for b in with_seen[:20]:
            model(b, args.k)  # warm-up
        seen_ms = min(p50_ms(model, with_seen, args.k) for _ in range(args.repeats))
        window_ms = min(p50_ms(model, window, args.k) for _ in range(args.repeats))
    print(f"forward p50 (best of {args.repeats}): with the seen list {seen_ms:.3f} ms, "
          f"window only {window_ms:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
