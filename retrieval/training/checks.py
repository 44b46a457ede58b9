"""``recserve train``'s checks against the data: what the config alone cannot know.

``train.toml`` is validated when it is read (``config.py``); these run once the data is loaded
and split, before the first step, so a run that would fail or learn nothing is refused (or
warned about) before any training, never after it:

- ``evaluate.k`` larger than the catalog: refused (recall@K needs K distinct items); we refuse
  rather than clamp so that the K in every reported figure is the K asked for;
- no training pair, no test user, or a validation split that holds out nothing: refused;
- an epoch of fewer than :data:`FEW_STEPS` steps: one warning naming ``train.batch_size``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from retrieval.training.config import PublishConfig, RunConfig
from retrieval.training.pairs import batch_starts
from retrieval.training.prepare import Prepared, SplitCounts

log = logging.getLogger(__name__)

FEW_STEPS = 10
"""Steps per epoch under which the batch size is called too large for the data."""


@dataclass(frozen=True)
class EpochPlan:
    """How the training pairs become steps."""

    pairs: int
    """Training pairs (after the test and validation splits)."""
    batch_size: int
    steps: int
    """Steps per epoch: full batches (one short one when there are fewer pairs than a batch)."""

    @property
    def unused_pairs(self) -> int:
        """Pairs left out of each epoch (the shuffled tail short of a full batch)."""
        return max(0, self.pairs - self.steps * self.batch_size)


def epoch_plan(pairs: int, batch_size: int) -> EpochPlan:
    """The steps of an epoch over ``pairs`` training pairs."""
    return EpochPlan(pairs, batch_size, len(batch_starts(pairs, batch_size)) if pairs else 0)


def check_run(cfg: RunConfig, prep: Prepared) -> EpochPlan:
    """Refuses (``ValueError`` naming the field) what cannot train or evaluate on this data;
    warns once when an epoch is a handful of steps. -> the epoch plan."""
    num_items = prep.dataset.num_items
    k = cfg.evaluate.k
    if k > num_items:
        raise ValueError(
            f"evaluate.k: {k} is larger than the catalog ({num_items} items); "
            f"set [evaluate] k to at most {num_items}"
        )
    counts = prep.counts
    if counts is None:
        raise ValueError("the prepared data has no split counts (prepare() builds them)")
    _check_split(counts, cfg.evaluate.validation)
    if cfg.publish is not None:
        _check_publish_plan(cfg.publish, prep)
    plan = epoch_plan(counts.train_pairs, cfg.train.batch_size)
    if plan.steps < FEW_STEPS:
        log.warning(
            "train.batch_size = %d against %d training pairs is %d step%s per epoch; "
            "lower it (at most %d gives %d steps an epoch)",
            plan.batch_size, plan.pairs, plan.steps, "" if plan.steps == 1 else "s",
            max(1, plan.pairs // FEW_STEPS), FEW_STEPS,
        )  # fmt: skip
    return plan


def _check_publish_plan(spec: PublishConfig, prep: Prepared) -> None:
    """The served tables fit ``[publish]``'s budgets (a hashed user table counted at one row a
    user, what it learns), else ``ValueError`` naming the budgets."""
    from dataclasses import replace

    from retrieval.model import table_specs
    from sharded_tables.placement import PlanError
    from sharded_tables.planner import plan
    from sharded_tables.specs import DType

    users = prep.dataset.num_users
    specs = [
        replace(s, rows=max(s.rows, users)) if s.hashed else s
        for s in table_specs(prep.config, DType(spec.table_dtype))
    ]
    try:
        plan(specs, spec.budgets())
    except PlanError as e:
        raise ValueError(f"publish.host_budget / publish.server_budget: {e}") from None


def _check_split(counts: SplitCounts, validation: float) -> None:
    if counts.train_pairs == 0:
        raise ValueError("data: no training interactions are left after the test split")
    if counts.users_in_test == 0:
        raise ValueError(
            f"data: no user has a test interaction: the time split holds out the latest of each "
            f"user's interactions only for users with at least 2 ({counts.users_kept_out_of_test} "
            f"users have a single one)"
        )
    if validation > 0 and counts.users_in_validation == 0:
        raise ValueError(
            f"evaluate.validation: {validation} holds out no interaction (every user's training "
            f"part is a single interaction); set [evaluate] validation = 0"
        )
