"""The exact test of filters naming a multi-valued hashed attribute, as tensors.

Such an attribute's signature test is a superset (``retrieval/value_lists.py``): an item holding
several values sets every value's digits, which mix. So a filter naming one compiles twice:

* its **signature clauses** (``FilterBatch.masks`` ...), a superset test, which the postings,
  bit slices and scans evaluate as for any filter: they find the candidates;
* its **exact clauses** (:class:`FilterVerify`): the same expression with each clause on such an
  attribute (an *atom*: ``tags in {a, b}``) read as a *virtual* bit past the signature's words,
  its negation as the next one, so every literal stays positive. An item's virtual bits come
  from the index's value keys (``IndexTensors.value_keys [K] int64`` sorted, ``position << 32 |
  code``, ``code = attribute << VALUE_BITS | value``): atom ``a`` holds when one of its codes
  ``atoms [A, S]`` is listed for the item, a ``searchsorted`` in fixed shapes.

Candidates pass when they pass both: exact answers from any path that finds its candidates by
the signature clauses (the exact scans, the device path's full scan, a fresh segment) and
verifies them here. Rows with exact clauses scan exactly (the planners force them): a list
scan's best ``r`` by the superset could miss items the verification keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from retrieval.filter_cnf import FilterSchema, lower, packed
from retrieval.filter_expr import Clause, Expr

VALUE_BITS = 27
"""A code's value field: 2^27 values an attribute."""
MAX_ATTRIBUTES = 32
"""Multi-valued hashed attributes an index may hold: the code's high field (a code < 2^32)."""


@dataclass
class FilterVerify:
    """A batch's exact clauses over the signature and its virtual words: ``masks [B, C, W2]
    int64``, ``negate [B, C] bool``, ``neg_masks [B, C, W2]`` (None: no "none of" part; as
    ``FilterBatch``), ``atoms [B, A, S] int64`` each row's atoms' codes (``-1`` pads), ``rows
    [B] bool`` the rows that have exact clauses (the others: none, always true)."""

    masks: torch.Tensor
    negate: torch.Tensor
    neg_masks: torch.Tensor | None
    atoms: torch.Tensor
    rows: torch.Tensor

    def to(self, device: torch.device | str) -> FilterVerify:
        nm = None if self.neg_masks is None else self.neg_masks.to(device)
        return FilterVerify(
            self.masks.to(device),
            self.negate.to(device),
            nm,
            self.atoms.to(device),
            self.rows.to(device),
        )

    def take(self, rows: torch.Tensor) -> FilterVerify:
        """The exact clauses of rows ``rows [b] int64``."""
        nm = None if self.neg_masks is None else self.neg_masks[rows]
        r = rows.to(self.rows.device)
        return FilterVerify(self.masks[rows], self.negate[rows], nm, self.atoms[rows], self.rows[r])

    def key(self) -> torch.Tensor:
        """``[B, *]`` int64: equal rows, equal keys (rows group by filter)."""
        parts = [self.masks.flatten(1), self.negate.long(), self.atoms.flatten(1)]
        if self.neg_masks is not None:
            parts.append(self.neg_masks.flatten(1))
        return torch.cat(parts, dim=1)


OneVerify = tuple[np.ndarray, np.ndarray, np.ndarray, list[list[int]]]
"""One filter's exact clauses: ``(masks [C, W2] int64, negate [C], neg_masks [C, W2], atoms)``."""


def compile_verify(
    schema: FilterSchema,
    expr: Expr,
    words: int,
    multi_valued: Sequence[str],
    position: Mapping[str, Mapping[str, int]],
) -> OneVerify:
    """``expr``'s exact clauses over ``words`` signature words and the virtual words of its
    atoms on ``multi_valued`` (sorted: an attribute's rank is its code's high field), values
    by ``position``."""
    atoms: dict[Clause, int] = {}
    first = words * 64

    def virtual(c: Clause) -> int | None:
        if c.attribute not in multi_valued:
            return None
        atom = Clause(c.attribute, tuple(sorted(set(c.values))))
        return first + 2 * atoms.setdefault(atom, len(atoms))

    clauses = lower(schema, expr, virtual=virtual)
    masks, negate, neg = packed(clauses, words + (2 * len(atoms) + 63) // 64)
    codes = []
    for atom in atoms:  # in bit order
        rank = list(multi_valued).index(atom.attribute) << VALUE_BITS
        pos = position[atom.attribute]
        codes.append([rank | pos[v] for v in atom.values if v in pos])  # unknown: nobody holds it
    return masks, negate, neg, codes


def batch_verify(parts: Sequence[OneVerify | None], take: np.ndarray) -> FilterVerify | None:
    """Each distinct filter's exact clauses (None: it names no multi-valued attribute) and the
    filter of each row ``take [B]`` -> the batch's :class:`FilterVerify`, padded (clauses: an
    always-true one, atoms: ``-1``), or None when no filter has any."""
    if all(p is None for p in parts):
        return None
    c = max(len(p[1]) for p in parts if p is not None)
    w2 = max(p[0].shape[1] for p in parts if p is not None)
    a = max(max(len(p[3]), 1) for p in parts if p is not None)
    s = max(max((len(x) for x in p[3]), default=1) for p in parts if p is not None)
    u = len(parts)
    masks = np.zeros((u, c, w2), dtype=np.int64)
    negate = np.ones((u, c), dtype=bool)
    neg = np.zeros_like(masks)
    atoms = np.full((u, a, max(s, 1)), -1, dtype=np.int64)
    has = np.zeros(u, dtype=bool)
    for i, p in enumerate(parts):
        if p is None:
            continue
        m, n, g, codes = p
        masks[i, : len(n), : m.shape[1]], negate[i, : len(n)], neg[i, : len(n), : m.shape[1]] = (
            m,
            n,
            g,
        )
        for j, vals in enumerate(codes):
            atoms[i, j, : len(vals)] = vals
        has[i] = True
    nm = torch.from_numpy(neg[take]) if neg.any() else None
    return FilterVerify(
        torch.from_numpy(masks[take]),
        torch.from_numpy(negate[take]),
        nm,
        torch.from_numpy(atoms[take]),
        torch.from_numpy(has[take]),
    )


def virtual_words(keys: torch.Tensor, pos: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
    """Items ``pos [..., M]`` against atoms ``atoms [..., A, S]`` (``-1`` pads) by value keys
    ``keys [K]`` (sorted) -> their virtual words ``[..., M, V]`` int64, ``V = ceil(2A / 64)``:
    bit ``2a`` when the item holds one of atom ``a``'s codes, bit ``2a + 1`` when it does not."""
    a = atoms.shape[-2]
    want = (pos[..., :, None, None] << 32) | atoms.unsqueeze(-3)  # [..., M, A, S]
    if keys.numel():
        at = torch.searchsorted(keys, want).clamp(max=keys.numel() - 1)
        hit = (keys[at] == want) & (atoms >= 0).unsqueeze(-3)
    else:
        hit = torch.zeros_like(want, dtype=torch.bool)
    holds = hit.any(dim=-1)  # [..., M, A]
    bits = torch.stack([holds, ~holds], dim=-1).flatten(-2)  # [..., M, 2A]: 2a holds, 2a+1 not
    v = (2 * a + 63) // 64
    bits = torch.nn.functional.pad(bits, (0, v * 64 - 2 * a))
    shifts = torch.arange(64, device=pos.device)
    return (bits.view(*bits.shape[:-1], v, 64).long() << shifts).sum(dim=-1)  # bit 63 wraps


def value_keys(
    item_ids: np.ndarray, value_lists: Mapping[str, object], ranks: Sequence[str]
) -> torch.Tensor:
    """The value keys ``[K] int64`` sorted (``position << 32 | code``) of items ``item_ids
    [N]`` (by position) holding the values ``value_lists`` give them (``ValueLists`` by item
    id), each attribute's code field its rank in ``ranks``."""
    if len(ranks) > MAX_ATTRIBUTES:
        raise ValueError(
            f"{len(ranks)} multi-valued hashed attributes; an index holds {MAX_ATTRIBUTES} at most"
        )
    parts = []
    for attr, vl in value_lists.items():
        ids, offsets, positions = vl.ids, vl.offsets, vl.positions  # type: ignore[attr-defined]
        if not ids.size or not item_ids.size:
            continue
        at = np.searchsorted(ids, item_ids).clip(max=ids.size - 1)
        listed = ids[at] == item_ids
        sizes = np.where(listed, offsets[at + 1] - offsets[at], 0)
        pos = np.repeat(np.arange(item_ids.size, dtype=np.int64), sizes)
        within = np.arange(pos.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        vals = positions[offsets[at][pos] + within].astype(np.int64)
        if vals.size and int(vals.max()) >> VALUE_BITS:
            raise ValueError(f"{attr!r}: a value position past 2^{VALUE_BITS}")
        parts.append(pos << 32 | (ranks.index(attr) << VALUE_BITS) | vals)
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy(np.unique(np.concatenate(parts)))
