"""A recall target per request: the index's settings for it, from curves measured at build.

A request may ask for a recall@K against exact search (``recall_target``, in ``(0, 1]``) instead
of the index's defaults. The build measures what each setting gives on sample queries:

* ``IndexStats.recall_curve``: ``(nprobe, recall)`` for nprobe = 1, 2, 4, ... until recall
  reaches :data:`CURVE_TOP` or every list (:func:`measure_recall_curve`); an unfiltered row
  probes the fewest lists whose measured recall reaches its target;
* ``IndexStats.slack_curve``: ``(quantile, slack)`` of the filtered plan's bound
  (``retrieval/index/bound.py``); a filtered row bounds the lists it did not probe with the
  slack of the quantile that reaches its target, so a stricter target probes further before it
  trusts its K-th result, at every selectivity;
* a target of 1 (or one above every measured point) scans the row's eligible items exactly:
  recall 1 against the vectors the index holds (its exact copy, else its decoded codes).

Rows without a target (0) keep the index's configured settings. :func:`row_settings` turns a
batch's targets into per-row settings; ``bench/filtered.py --recall-targets`` measures that
each target holds at 50 / 20 / 10 / 1 / 0.1 % selectivity on anti-correlated data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

CURVE_TOP = 0.995
"""The recall curve is measured until a setting reaches this (or every list is probed)."""
SLACK_QUANTILES = (0.5, 0.8, 0.9, 0.95, 0.99)
"""The quantiles whose bound slack the build records."""


@dataclass(frozen=True)
class RowSettings:
    """Per-row search settings for B rows: ``nprobe [B] int64`` (lists probed before the
    selectivity widening), ``slack [B] float32`` (the bound's slack for filtered rows) and
    ``exact [B] bool`` (scan the row's eligible items exactly)."""

    nprobe: torch.Tensor
    slack: torch.Tensor
    exact: torch.Tensor


def check_targets(target: torch.Tensor, batch: int) -> None:
    """Edge validation: ``target [B] float32``, each 0 (the index's defaults) or in (0, 1]."""
    if target.dim() != 1 or target.shape[0] != batch or not target.is_floating_point():
        raise ValueError(
            f"recall_target: expected floats [{batch}], got {target.dtype} {list(target.shape)}"
        )
    if not bool(((target >= 0) & (target <= 1)).all()):
        raise ValueError("recall_target: each must be in (0, 1] (0: the index's defaults)")


def row_settings(
    target: torch.Tensor,
    nprobe: int,
    slack: float,
    recall_curve: Sequence[Sequence[float]],
    slack_curve: Sequence[Sequence[float]],
) -> RowSettings:
    """``target [B]`` (0: defaults ``nprobe`` / ``slack``) -> :class:`RowSettings`.

    ``ValueError`` when a row asks for a target below 1 and the index measured no recall curve
    (built without ``target_recall``): there is nothing to read its settings from."""
    t = [round(x, 6) for x in target.detach().float().cpu().tolist()]  # float32 0.99 > 0.99
    asks = [x for x in t if 0 < x < 1]
    if asks and not recall_curve:
        raise ValueError(
            "recall_target: this index measured no recall curve (build it with "
            "IVFConfig.target_recall > 0, as `recserve train` does); send 0 or 1"
        )
    probes, slacks, exact = [], [], []
    for x in t:
        if x <= 0:
            probes.append(nprobe)
            slacks.append(slack)
            exact.append(False)
            continue
        p = _first_reaching(recall_curve, x)
        s = next((float(v) for q, v in slack_curve if q >= x), 1.0)
        probes.append(p or (int(recall_curve[-1][0]) if recall_curve else nprobe))
        slacks.append(s)
        exact.append(x >= 1.0 or p is None)
    return RowSettings(
        torch.tensor(probes, dtype=torch.int64),
        torch.tensor(slacks, dtype=torch.float32),
        torch.tensor(exact, dtype=torch.bool),
    )


def curve_nprobe(recall_curve: Sequence[Sequence[float]], target: float, nlist: int) -> int:
    """The fewest lists whose measured recall reaches ``target`` (``nlist`` if none does)."""
    p = _first_reaching(recall_curve, target)
    return nlist if p is None else p


def _first_reaching(recall_curve: Sequence[Sequence[float]], target: float) -> int | None:
    return next((int(n) for n, rec in recall_curve if rec >= target), None)
