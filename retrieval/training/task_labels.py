"""Per-task labels of training pairs: what each output of the multi-task head learns.

The scoring head (``retrieval/scoring.py``) predicts one logit per task in
``ModelConfig.head_tasks`` and serves their weighted sum (``head_task_weights``) as one value.
A task's name says what its label is, read from the interaction (``Interactions.value``: a
rating, a watch fraction)::

    engagement      1 for every interaction (the user chose the item)
    value>=4        1 when the interaction's value is at least 4 (MovieLens: liked)
    value>0.5       likewise with a strict bound
    anything else   no label of its own (NaN): the task learns through the softmax only, as
                    every task did before labels existed ("click", "watch")

Sampled negatives (the other columns of a step) are 0 for every labelled task. Example::

    task_labels(["engagement", "value>=4"], interactions)   # [M, 2] float32
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from retrieval.data import Interactions

_VALUE_RULE = re.compile(r"^value\s*(>=|>)\s*(-?[0-9]+(?:\.[0-9]+)?)$")


def task_labels(tasks: Sequence[str], interactions: Interactions) -> np.ndarray:
    """``[M, T] float32`` labels of the M interactions for the T ``tasks`` (NaN: a task without
    a label rule); raises ``ValueError`` naming a ``value`` rule that does not parse or that
    needs values the data lacks."""
    out = np.zeros((len(interactions), len(tasks)), dtype=np.float32)
    for t, task in enumerate(tasks):
        out[:, t] = _label(task, interactions)
    return out


def _label(task: str, interactions: Interactions) -> np.ndarray:
    if task == "engagement":
        return np.ones(len(interactions), dtype=np.float32)
    rule = _VALUE_RULE.match(task.strip())
    if rule is None:
        if task.strip().startswith("value"):  # meant as a rule: a typo must not train silently
            raise ValueError(f"head_tasks: {task!r} is not a label rule (value>=X, value>X)")
        return np.full(len(interactions), np.nan, dtype=np.float32)
    if interactions.value is None:
        raise ValueError(
            f"head_tasks: {task!r} reads the interactions' value, and this data has none"
        )
    op, bound = rule.group(1), float(rule.group(2))
    hit = interactions.value >= bound if op == ">=" else interactions.value > bound
    return hit.astype(np.float32)
