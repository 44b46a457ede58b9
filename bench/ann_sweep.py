"""The sweep runner of ``bench/ann.py``: measure a system setting by setting on one filter case.

A :class:`Case` is one filter level with its exact ground truth; :func:`sweep` walks a system's
settings (nprobe ascending), measuring each as a :class:`~ann_report.Point`, and stops once more
work cannot buy recall. Searchers come from a ``make(params) -> (batch, one)`` factory so that
per-setting objects (faiss ``SearchParametersIVF``, compiled filters) are built outside timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable

import numpy as np
from ann_data import recall_at_k
from ann_report import Point
from ann_rounds import Kept
from timing import OtherLoad, time_batched, time_single
from tqdm import tqdm

# make(params) -> (batch(): ids [B, K], one(i): search query i alone)
Searcher = tuple[Callable[[], np.ndarray], Callable[[int], object]]


@dataclasses.dataclass
class Case:
    """One filter level: its label, measured selectivity, exact ground truth and eligible ids."""

    label: str
    expression: str | None
    selectivity: float
    truth: np.ndarray  # (B, K) int64
    keep: np.ndarray | None = None  # (N,) bool
    eligible: np.ndarray | None = None  # (M,) int64
    prep_ms: float = 0.0  # mask from codes + packbits, paid outside every timed call


def sweep(
    system: str,
    settings: list[tuple[str, dict]],
    make: Callable[[dict], Searcher],
    case: Case,
    bpi: float,
    args: argparse.Namespace,
    through: str | None = None,
    errors: dict[str, str] | None = None,
    kept: Kept | None = None,
    prepare: Callable[[], None] = lambda: None,
) -> list[Point]:
    """Measure each setting in order; stop once recall reaches ``--stop-recall`` or plateaus.

    The plateau rule ends sweeps whose recall is capped below the stop value by the codes
    (SQ8, int8): more lists only cost time there. ``through`` names a setting the sweep must
    reach before it may stop (the settings ANCHORS.md quotes). A point measured while other
    processes used more than ``--busy-threshold`` of the machine is measured again (up to
    ``--busy-retries`` times) and the least disturbed measurement is kept. With ``errors``, a
    setting that raises is recorded there and skipped instead of ending the run. ``kept``
    keeps each setting's searchers, with ``prepare`` (the state they were swept under), for
    ``--rounds`` (``ann_rounds.py``).
    """
    points: list[Point] = []
    names = [name for name, _ in settings]
    must = names.index(through) if through in names else -1
    for i, (name, params) in enumerate(
        tqdm(settings, desc=f"{system} [{case.label}]", leave=False, file=sys.stderr)
    ):
        batch, one = make(params)
        if kept is not None:
            kept.keep(system, case.label, name, batch, one, prepare)
        try:
            tries = [measure(system, name, params, batch, one, case, bpi, args)]
        except Exception as e:
            if errors is None:
                raise
            errors[f"{system} [{case.label}] {name}"] = f"{type(e).__name__}: {e}"
            continue
        while tries[-1].others_cpu > args.busy_threshold and len(tries) <= args.busy_retries:
            time.sleep(1.0)
            tries.append(measure(system, name, params, batch, one, case, bpi, args))
        points.append(min(tries, key=lambda p: p.others_cpu))
        recall = points[-1].recall
        # Only a high recall can plateau: at 0.1 % selectivity early steps gain ~1e-4 each. Two
        # steps must gain too little: an index that widens small nprobe itself (ours: enough lists
        # for 2r candidates) measures the same recall at nprobe 1 and 2.
        plateaued = len(points) > 2 and recall >= 0.9 and recall - points[-3].recall < args.plateau
        if (recall >= args.stop_recall or plateaued) and i >= must:
            break
    return points


def measure(system, name, params, batch, one, case: Case, bpi: float, args) -> Point:
    """One point: batched q/s (median of ``--repeats``), recall of that batch, single-query p50."""
    load = OtherLoad()
    load.start()
    ids, median_s, runs = time_batched(batch, repeats=args.repeats)
    recall = recall_at_k(ids, case.truth)
    p50, p99 = time_single(one, n=args.single)
    return Point(
        system=system,
        setting=name,
        filter=case.label,
        selectivity=case.selectivity,
        recall=recall,
        qps_batch=args.queries / median_s,
        qps_batch_best=args.queries / min(runs),
        p50_single_ms=p50,
        p99_single_ms=p99,
        bytes_per_item=bpi,
        params=params,
        batch_runs_s=runs,
        others_cpu=load.stop(),
    )
