"""What the build measured on this index, read from one place.

The planner, the bound check and the cost model read the build's measurements (the list plan's
and the exact scan's times, the recall and slack curves, the bound's slack) only through these
accessors, so where the measurements are kept is said once.
"""

from __future__ import annotations

from retrieval.index.config import IVFConfig


def plan_costs(config: IVFConfig) -> tuple[tuple[float, ...], ...]:
    """Rows of the plans' measured times (``costs.py`` names the columns); empty: unmeasured."""
    return config.plan_costs


def recall_curve(config: IVFConfig) -> tuple[tuple[int, float], ...]:
    """``(nprobe, recall)`` measured on sample queries (``targets.py``); empty: unmeasured."""
    return config.recall_curve


def slack_curve(config: IVFConfig) -> tuple[tuple[float, float], ...]:
    """``(quantile, slack)`` of the filtered plan's bound (``targets.py``)."""
    return config.slack_curve


def bound_slack(config: IVFConfig) -> float:
    """The slack a filtered row's bound check uses by default (0: no check, ``bound.py``)."""
    return config.filter_bound_slack
