"""The index's saved format: a version in its state, and :func:`migrate`, one step per earlier
version, that brings an older state to this one before it loads (a published version in a
user's repository keeps loading, and answers as it did).

The index's state is its ``state_dict`` (prefix removed): the buffers and ``_extra_state``
(``{"format", "config", "stats", "dim", "attribute_values"}``); a shard's ``index.json`` is that
extra state alone (``{"_extra_state": meta}`` to :func:`migrate`).

Versions:

- 0: no version (every index saved up to this format). Its config held what the build
  measured (``filter_bound_slack``, ``slack_curve``, ``recall_curve``, ``plan_costs``); and the
  oldest states lack what came later: ``probe`` and ``assign`` (such indexes probe by "ip" over
  lists assigned by L2), the buffers ``list_radius``, ``list_bits`` (no bound check) and
  ``built_sizes`` (``nprobe`` lists a row), or keep float32 row scales.
- 1: a ``format`` in the extra state; the measurements in ``stats`` (``stats.py``).
- 2: the buffer ``filter_sample`` (``selectivity.py``); an older index with items takes its
  signatures' sample, one without (a router's) none: it estimates as its version did.

``tests/retrieval/test_format.py`` loads a fixture of each (model folders and shards).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from retrieval.index.selectivity import sample_rows

State = dict[str, Any]
Step = Callable[[State], State]

INDEX_FORMAT = 2
"""The version this code writes."""
EXTRA = "_extra_state"
MEASURED = ("filter_bound_slack", "slack_curve", "recall_curve", "plan_costs")
"""What a version-0 config held of the build's measurements (version 1: ``stats``)."""


def version_of(extra: Mapping[str, Any]) -> int:
    """The format of an index's extra state (0: saved before formats had a version)."""
    version = extra.get("format", 0)
    if type(version) is not int or version < 0:
        raise ValueError(f"index state: format must be an int >= 0, got {version!r}")
    return version


def migrate(state: State, version: int) -> State:
    """``state`` (an index's state dict, or ``{"_extra_state": meta}``) of format ``version``
    -> the same state in :data:`INDEX_FORMAT`; a copy, the tensors shared where unchanged."""
    return run_steps(state, version, STEPS, INDEX_FORMAT, "index state")


def run_steps(
    state: State, version: int, steps: Mapping[int, Step], current: int, what: str
) -> State:
    """Applies ``steps[version]``, ``steps[version + 1]``, ... up to ``current``; ``ValueError``
    naming ``what`` for a version newer than this code reads."""
    if version > current:
        raise ValueError(
            f"{what}: format {version} was written by a newer recserve (this one reads up to "
            f"{current}); upgrade recserve to load it"
        )
    state = dict(state)
    for v in range(version, current):
        state = steps[v](state)
    return state


def _from_unversioned(state: State) -> State:
    """Version 0 -> 1: the measurements leave the config; what older indexes lacked is what
    they searched with."""
    extra = dict(state[EXTRA])
    config = dict(extra["config"])
    config.setdefault("probe", "ip")  # saved before the option: probed by inner product
    config.setdefault("assign", "l2")  # saved before the option: lists by nearest centroid
    extra["stats"] = {k: config.pop(k) for k in MEASURED if k in config}
    extra["config"], extra["format"] = config, 1
    state[EXTRA] = extra
    if "sig" in state:  # the buffers (not a shard's index.json)
        _buffers_of_version_0(state)
    return state


def _buffers_of_version_0(state: State) -> None:
    """Buffers an index saved before them lacks load empty (no bound statistics: no bound
    check; no sizes as built: ``nprobe`` lists a row); float32 row scales become bfloat16, each
    list's radius widened to the decoded residuals the rounding moved (it must stay a bound)."""
    words = state["sig"].shape[1]
    state.setdefault("list_radius", torch.zeros(0))
    state.setdefault("list_bits", torch.zeros(0, words, dtype=torch.int64))
    state.setdefault("built_sizes", torch.zeros(0, dtype=torch.int64))
    if state["scales"].dtype == torch.float32:
        from retrieval.index.bound import widened_radius

        state["scales"] = state["scales"].bfloat16()
        radius, codes = state["list_radius"], state["codes"]
        if radius.numel() and codes.shape[0]:
            state["list_radius"] = widened_radius(radius, codes, state["scales"], state["offsets"])


def _with_filter_sample(state: State) -> State:
    """Version 1 -> 2: the planner's sample of signatures, read off the saved ones (an
    index's ``_refresh`` reads it again whenever it holds items)."""
    extra = dict(state[EXTRA])
    extra["format"] = 2
    state[EXTRA] = extra
    if "sig" in state:  # the buffers (not a shard's index.json)
        sig = state["sig"]
        state.setdefault("filter_sample", sig[sample_rows(sig.shape[0]).to(sig.device)])
    return state


STEPS: dict[int, Step] = {0: _from_unversioned, 1: _with_filter_sample}
"""``STEPS[v]`` turns a version-``v`` state into a version ``v + 1`` one."""
