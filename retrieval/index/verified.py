"""Searches under filters naming a multi-valued hashed attribute: exact and verified.

Such an attribute's signature test is a superset (``retrieval/value_lists.py``), so these rows
take the exact scan of their eligible items: the items passing the signatures (C++
``eligible_rows`` / the values' postings, :func:`~retrieval.index.eligible_scan.eligible_positions`),
then each re-checked against the index's value lists, the false positives dropped, and only then
scored and cut to the top-K: a row has ``k`` results whenever ``k`` items truly pass.

Every other path that could admit such an item refuses it with an error naming the attribute: a
precompiled :class:`FilterBatch` (it carries no expression to verify), the IVF scan and the
Triton kernel (they never see these rows), a router's shard candidates and an index with live
rows beside it (its fresh segment keeps no value lists: compact first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from retrieval.filter_expr import Expr, parse_filter
from retrieval.filters import WORD_BITS, FilterBatch, FilterSchema, eligible, pack_bits
from retrieval.index.eligible_scan import eligible_positions
from retrieval.index.exact import exact_topk
from retrieval.index.readout import scores_at
from retrieval.index.tensors import IndexTensors
from retrieval.value_lists import ValueLists, names_any, verify


def routed_rows(
    value_lists: Mapping[str, ValueLists], filters: str | Sequence[str | None], batch: int
) -> tuple[list[int], list[Expr]]:
    """The rows of a batch whose filter text names a multi-valued hashed attribute, and their
    parsed filters (one text: every row or none)."""
    texts = [filters] * batch if isinstance(filters, str) else list(filters)
    rows, exprs = [], []
    for i, text in enumerate(texts):
        if text is None:
            continue
        if not isinstance(text, str):
            raise ValueError(
                f"filters[{i}]: an index with multi-valued hashed attributes "
                f"({', '.join(sorted(value_lists))}) takes filters as text"
            )
        expr = parse_filter(text)
        if names_any(expr, value_lists) is not None:
            rows.append(i)
            exprs.append(expr)
    return rows, exprs


def refuse_compiled(schema: FilterSchema, fb: FilterBatch, where: str) -> None:
    """``ValueError`` naming the attribute when compiled filters ``fb`` read the bits of a
    multi-valued hashed attribute: ``where`` (a path without the filter's expression) could
    not verify its superset test."""
    read = fb.masks if fb.neg_masks is None else fb.masks | fb.neg_masks
    read = read.reshape(-1, read.shape[-1]).cpu()
    for attr in sorted(schema.multi_valued):
        bits = np.zeros(schema.num_words * WORD_BITS, dtype=bool)
        bits[schema.attribute_bits(attr)] = True
        if (read & pack_bits(bits[None, :])).ne(0).any():
            raise ValueError(
                f"filter on {attr!r}: a multi-valued hashed attribute is answered only by "
                f"IVFIndex.search with filter text (verified exactly); {where} refuses it"
            )


def verified_search(
    t: IndexTensors,
    q: torch.Tensor,
    k: int,
    exprs: Sequence[Expr],
    schema: FilterSchema,
    value_lists: Mapping[str, ValueLists],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` of ``q [B, D]`` under ``exprs`` (one a row), every candidate verified
    against ``value_lists`` -> ``(positions [B, k], scores [B, k])``, ``-1`` / ``-inf`` padded."""
    b = q.shape[0]
    pos = torch.full((b, k), -1, dtype=torch.int64, device=q.device)
    scores = torch.full((b, k), float("-inf"), device=q.device)
    groups: dict[Expr, list[int]] = {}
    for i, e in enumerate(exprs):
        groups.setdefault(e, []).append(i)
    for expr, rows in groups.items():
        subset = verified_positions(t, expr, schema, value_lists)
        at = torch.tensor(rows, dtype=torch.int64, device=q.device)
        p, s = exact_topk(q[at], k, subset, lambda qq, pp: scores_at(t, qq, pp))
        pos[at], scores[at] = p, s
    return pos, scores


def verified_positions(
    t: IndexTensors, expr: Expr, schema: FilterSchema, value_lists: Mapping[str, ValueLists]
) -> torch.Tensor:
    """Positions ``[M]`` of the items passing ``expr`` exactly: those its signature test admits
    (a superset), less those their value lists refute."""
    fb = schema.compile([expr]).to(t.lists.sig.device)
    none = None if fb.neg_masks is None else fb.neg_masks[0]
    cand = eligible_positions(t, fb.masks[0], fb.negate[0], none)  # [M'] superset
    sig = t.lists.sig.index_select(0, cand)
    ids = t.item_ids.index_select(0, cand).cpu().numpy()

    def atom_test(atom: Expr) -> np.ndarray:
        one = schema.compile([atom]).to(sig.device)
        nm = None if one.neg_masks is None else one.neg_masks[0]
        return eligible(sig, one.masks[0], one.negate[0], nm).cpu().numpy()

    ok = verify(expr, atom_test, ids, value_lists, schema.position)
    return cand[torch.from_numpy(ok).to(cand.device)]
