"""The baselines of ``bench/quality.py``: popularity, item-kNN and EASE on the model's split.

Item-kNN and EASE are fitted on the model's training pairs (``prep.train``) and read each user's
consumed items before the test split (``prep.seen``) as their profile; every method excludes the
same items as the model in each mode:

* ``full``: every item the user consumed before the test split (``prep.seen``);
* ``window``: the ``history_len`` most recent only (what the model excluded before issue 19).

Their one setting (EASE's lambda, item-kNN's neighbours) is tuned on a validation split cut from
the training part (``prepare(ds, validation=...)``: each user's latest share of the training
interactions), never on the test split, by recall@K with full exclusion; the chosen value is then
refitted on all training pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from retrieval.baselines import ease_weights, gram_of, itemknn_weights, recommend_items
from retrieval.metrics import popularity_recs, ranking_metrics
from retrieval.seen import SeenSets
from retrieval.training.prepare import Prepared, prepare

GRIDS: dict[str, tuple[float, ...]] = {
    "EASE": (50.0, 100.0, 200.0, 300.0, 500.0, 1000.0, 2000.0),
    "item-kNN": (20, 50, 100, 200, 0),
}
"""Values tried per method: EASE's lambda; item-kNN's neighbours per item (0: all)."""
SETTING = {"EASE": "lambda", "item-kNN": "neighbours"}
MODES = ("full", "window")

Weights = Callable[[torch.Tensor, float], torch.Tensor]
FITS: dict[str, Weights] = {
    "EASE": lambda gram, v: ease_weights(gram, float(v)),
    "item-kNN": lambda gram, v: itemknn_weights(gram, int(v)),
}


def exclusions(prep: Prepared, users: np.ndarray) -> dict[str, np.ndarray]:
    """Per mode, the items ``users [U]`` may not be recommended: ``[U, S]`` (``-1`` pads)."""
    assert prep.seen is not None  # prepare() fills it
    return {"full": prep.seen.rows(users).numpy(), "window": prep.history[users]}


def item_item_recs(
    weights: torch.Tensor,
    profiles: SeenSets,
    users: np.ndarray,
    exclude: np.ndarray,
    k: int,
    chunk: int = 1024,
) -> np.ndarray:
    """Top-``k`` ``[U, k]`` of ``users`` scored by ``weights [N, N]`` from their ``profiles``."""
    n = int(weights.shape[0])
    out = []
    for s in range(0, len(users), chunk):
        part = users[s : s + chunk]
        ex = torch.from_numpy(exclude[s : s + chunk])
        out.append(recommend_items(weights, profiles.indicator(part, n), ex, k).numpy())
    return np.concatenate(out)


def tune(
    name: str, prep_val: Prepared, k: int, grid: tuple[float, ...] | None = None
) -> dict[str, Any]:
    """``name``'s setting with the best validation recall@``k`` -> ``{"value", "recall": {v: r}}``."""
    seen = prep_val.train_seen
    assert seen is not None
    users = np.array([u for u, items in enumerate(prep_val.validation_items) if items])
    relevant = [prep_val.validation_items[u] for u in users]
    gram = gram_of(seen, prep_val.dataset.num_items)
    exclude = seen.rows(users).numpy()
    recall = {}
    for v in grid or GRIDS[name]:
        recs = item_item_recs(FITS[name](gram, v), seen, users, exclude, k)
        recall[v] = ranking_metrics(recs, relevant, k)[f"recall@{k}"]
    best = max(recall, key=lambda v: recall[v])  # the first of equals: the grid's order
    return {"value": best, "recall": recall, "users": len(users)}


def baseline_recs(
    prep: Prepared, users: np.ndarray, k: int, validation: float
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """``({method: {mode: recs [U, k]}}, {method: its tuning or why it was skipped})``."""
    ds = prep.dataset
    excl = exclusions(prep, users)
    out = {
        "popularity": {
            m: popularity_recs(prep.train.item_ids, ds.num_items, e, k) for m, e in excl.items()
        }
    }
    info: dict[str, Any] = {}
    assert prep.seen is not None and prep.train_seen is not None
    gram = gram_of(prep.train_seen, ds.num_items)
    prep_val = prepare(ds, history_len=prep.config.history_len, validation=validation)
    for name in FITS:
        try:
            tuned = tune(name, prep_val, k)
            weights = FITS[name](gram, tuned["value"])
        except ValueError as e:  # EASE on a catalog whose dense inverse does not fit
            info[name] = {"skipped": str(e)}
            print(f"{ds.name}: {name} skipped: {e}", flush=True)
            continue
        info[name] = {SETTING[name]: tuned["value"], **tuned}
        out[name] = {m: item_item_recs(weights, prep.seen, users, e, k) for m, e in excl.items()}
    return out, info
