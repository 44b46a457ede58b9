"""Candidates verified against a filter's exact clauses (``retrieval/filter_verify.py``).

A filter naming a multi-valued hashed attribute finds its candidates by its signature clauses,
a superset test; every path then keeps only those passing its exact clauses, read off the
signatures and the items' virtual words (their value keys), so an answer never holds an item
the filter refutes. Rows with exact clauses scan exactly (``planner.make_plan``,
``device_plan.device_plan``): the paths that verify are those exact scans
(``eligible_scan.exact_search``, ``cpu_backend.shared_exact_ids``, ``device_search.exact_all``,
which checks every item in fixed shapes) and a fresh segment's candidates
(``fresh.LiveSegment``, its rows' values by their ids).
"""

from __future__ import annotations

import torch

from retrieval.filter_verify import FilterVerify, virtual_words
from retrieval.filters import eligible
from retrieval.index.tensors import IndexTensors


def extended(
    keys: torch.Tensor, pos: torch.Tensor, sig: torch.Tensor, v: FilterVerify
) -> torch.Tensor:
    """Items at positions ``pos [M]`` with signatures ``sig [M, W]`` and value keys ``keys
    [K]``, as every row of ``v`` reads them -> ``[B, M, W2]`` int64: the signature and the
    row's virtual words, cut or padded to its exact clauses' width."""
    b, m = v.rows.shape[0], pos.shape[0]
    words = virtual_words(keys.to(pos.device), pos.expand(b, m), v.atoms)  # [B, M, V]
    ext = torch.cat([sig.unsqueeze(0).expand(b, m, sig.shape[1]), words], dim=2)
    w2 = v.masks.shape[2]
    return torch.nn.functional.pad(ext[:, :, :w2], (0, max(0, w2 - ext.shape[2])))


def passes_exact(
    keys: torch.Tensor, pos: torch.Tensor, sig: torch.Tensor, v: FilterVerify, row: int
) -> torch.Tensor:
    """Which items at positions ``pos [M]`` (their signatures ``sig [M, W]``, value keys
    ``keys [K]``) pass row ``row`` of ``v`` -> ``[M] bool`` (all, where the row has no exact
    clauses)."""
    if not bool(v.rows[row]):
        return torch.ones(pos.shape[0], dtype=torch.bool, device=pos.device)
    one = v.take(torch.tensor([row], device=v.rows.device))
    ext = extended(keys, pos, sig, one)[0]
    none = None if one.neg_masks is None else one.neg_masks[0]
    return eligible(ext, one.masks[0], one.negate[0], none)


def verified_positions(
    t: IndexTensors, cand: torch.Tensor, v: FilterVerify | None, row: int
) -> torch.Tensor:
    """Candidate positions ``cand [M]`` of the main index -> those passing row ``row`` of ``v``
    (all where ``v`` is None or the row has no exact clauses)."""
    if v is None or not bool(v.rows[row]):
        return cand
    return cand[passes_exact(t.value_keys, cand, t.lists.sig.index_select(0, cand), v, row)]
