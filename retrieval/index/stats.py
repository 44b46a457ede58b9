"""What an index's build measured on its machine and data (:class:`IndexStats`), apart from the
settings it was built with (``config.py``): saved with the index (its extra state, a shard's
``index.json``) and loaded with it, so a loaded index plans as the built one did."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field

from common.config import Config


def _tuples(value: Any) -> Any:
    """JSON and TOML give lists where the stats hold tuples (rows of numbers)."""
    if isinstance(value, list):
        return tuple(tuple(row) if isinstance(row, list) else row for row in value)
    return value


Rows = Annotated[tuple[tuple[float, ...], ...], BeforeValidator(_tuples)]
Curve = Annotated[tuple[tuple[float, float], ...], BeforeValidator(_tuples)]
RecallCurve = Annotated[tuple[tuple[int, float], ...], BeforeValidator(_tuples)]


class IndexStats(Config):
    """The build's measurements (each empty or 0 where it measured none: the search then falls
    back to the config's constants). Frozen: a plan may cache what it read from them."""

    model_config = ConfigDict(frozen=True)

    filter_bound_slack: float = Field(default=0.0, ge=0, le=1)
    """The slack of ``IVFConfig.filter_bound`` (``retrieval/index/bound.py``): that quantile of
    the share of ``|q| * rmax`` that the best item of a list near a sample query reaches (1.0:
    the proof; 0: not measured, so no bound check)."""
    slack_curve: Curve = ()
    """``(quantile, slack)`` of the filtered plan's bound at ``targets.SLACK_QUANTILES``: the
    slack a request's ``recall_target`` bounds unprobed lists with."""
    recall_curve: RecallCurve = ()
    """``(nprobe, recall)`` measured with ``IVFConfig.target_recall`` (powers of two, until
    recall ``targets.CURVE_TOP``): what a request's ``recall_target`` probes
    (``retrieval/index/targets.py``)."""
    plan_costs: Rows = ()
    """``(batch, selectivity, exact seconds per eligible item, list plan seconds per query, its
    first round's lists, codes its rounds scanned)`` for one query and for a batch
    (``retrieval/index/calibrate.py`` measures them, ``costs.py`` reads them)."""
