"""An index whose recorded plan costs are set by the test, not measured by its build: the
planner's choice between lists and the exact scan then follows the test, not the machine's load
during the build's calibration."""

from __future__ import annotations

from retrieval.index import IVFIndex


def with_costs(index: IVFIndex, exact_item_s: float, list_query_s: float) -> IVFIndex:
    """A copy of ``index`` whose recorded costs are flat: these seconds at every selectivity."""
    rows = tuple(
        (b, s, exact_item_s, list_query_s, 1.0, 1000.0) for b in (1.0, 32.0) for s in (0.5, 0.01)
    )
    out = IVFIndex(index.config, index.dim, index.schema.attribute_values)
    out.load_state_dict(index.state_dict())
    out.stats = index.stats.model_copy(update={"plan_costs": rows})
    return out
