"""A filter expression -> the clauses the scans evaluate: a conjunction of "any of these bits"
clauses and "none of these bits" clauses, either joined in one clause with a "none of these
bits" part (``masks [C, W]`` / ``negate [C]`` / ``none [C, W]``, see ``retrieval/filters.py``).

``not`` is pushed down to the predicates, then ``or`` is distributed over ``and`` (conjunctive
normal form), so a clause is a disjunction of predicates: it keeps the scans' shape when its
predicates are all positive (their bits OR together), one negated predicate alone, or
positive predicates and one negated category ("a != x or b = y": "any of these bits, or none
of those"). Two negated categories in one ``or`` are refused, naming them.

Numbers compare as float32 (an item's value and the filter's bound both rounded to the nearest
float32, so ``price = 0.1`` finds the items given 0.1), exactly, without a second pass over
stored values: a numeric attribute stores its value's order-preserving 32-bit key (``-0`` read
as ``0``) as 8 hex digits, each digit
one-hot in 16 bits (128 bits an item). ``key <= K`` is the conjunction over digits ``d`` of
"``key_d <= K_d``, or a higher digit ``e`` has ``key_e < K_e``": each a clause of positive bits
(8 at most); ``>=`` likewise, ``in {...}`` a clause per digit prefix the values share (8 for
one value), ``!=`` one clause. Any float32 an
upsert brings encodes the same way; the build chooses nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from retrieval.filter_expr import And, Clause, Compare, Expr, FilterTooLargeError, Not, Or


class FilterSchema(Protocol):
    """What compiling needs of ``retrieval.filters.FilterSchema`` (which imports this module):
    the numeric attributes' first bits, and the bits of a categorical clause."""

    @property
    def numeric_base(self) -> Mapping[str, int]: ...

    def known(self, attr: str) -> None: ...

    def clause_bits(self, clause: Clause) -> list[int]: ...

    def hashed(self, clause: Clause) -> tuple[int, int, list[int]] | None: ...


DIGITS, DIGIT_BITS = 8, 4
NUMERIC_BITS = DIGITS << DIGIT_BITS
"""Signature bits of one numeric attribute: 8 digits of 16 one-hot bits."""
MAX_COMPILED_CLAUSES = 256
"""Clauses one filter may compile to: distributing ``or`` over ``and`` multiplies clause
counts, and the scans test every clause on every candidate."""

_Clause = tuple[int, tuple[tuple[int, str], ...]]
"""One disjunction: positive bits (an int as a bit set), and "none of these bits" parts with
the text of the predicate each came from."""
_FALSE: _Clause = (0, ())


def numeric_keys(x: np.ndarray) -> np.ndarray:
    """``[n]`` numbers -> their order-preserving float32 keys ``[n] uint32`` (``ValueError`` on NaN)."""
    with np.errstate(over="ignore"):
        f = np.asarray(x, dtype=np.float64).astype(np.float32) + np.float32(0)  # -0 -> +0
    if np.isnan(f).any():
        raise ValueError("a numeric attribute cannot hold NaN")
    u = f.view(np.uint32)
    return np.where(u >> 31 != 0, ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def numeric_bits(keys: np.ndarray, base: int, digits: int = DIGITS) -> np.ndarray:
    """Keys ``[n] uint32`` -> the signature bit of each digit ``[n, digits] int64``."""
    d = np.arange(digits, dtype=np.uint32)
    digit = (keys.astype(np.uint32)[:, None] >> (d * DIGIT_BITS)) & 15
    return base + (d.astype(np.int64) << DIGIT_BITS) + digit.astype(np.int64)


def _bound_key(t: float) -> int:
    """The key of bound ``t`` rounded to float32 (the nearest; past float32's range: inf)."""
    return int(numeric_keys(np.array([t]))[0])


def _digit_range(base: int, d: int, lo: int, hi: int) -> int:
    """Bits of digit ``d`` holding ``lo .. hi`` (inclusive), as a bit set."""
    if hi < lo:
        return 0
    return ((1 << (hi - lo + 1)) - 1) << (base + (d << DIGIT_BITS) + lo)


def _key_le(base: int, k: int) -> list[_Clause]:
    out: list[_Clause] = []
    for d in range(DIGITS - 1, -1, -1):
        kd = (k >> (d * DIGIT_BITS)) & 15
        if kd == 15:
            continue
        bits = _digit_range(base, d, 0, kd)
        for e in range(d + 1, DIGITS):
            bits |= _digit_range(base, e, 0, ((k >> (e * DIGIT_BITS)) & 15) - 1)
        out.append((bits, ()))
    return out


def _key_ge(base: int, k: int) -> list[_Clause]:
    out: list[_Clause] = []
    for d in range(DIGITS - 1, -1, -1):
        kd = (k >> (d * DIGIT_BITS)) & 15
        if kd == 0:
            continue
        bits = _digit_range(base, d, kd, 15)
        for e in range(d + 1, DIGITS):
            bits |= _digit_range(base, e, ((k >> (e * DIGIT_BITS)) & 15) + 1, 15)
        out.append((bits, ()))
    return out


def _key_in(base: int, keys: list[int], width: int = DIGITS) -> list[_Clause]:
    """``key`` is one of ``keys``: for every prefix ``p`` the keys share (a trie node), "the
    key's higher digits differ from ``p``, or its next digit is one that follows ``p``" -- a
    clause of positive bits per node, so a set costs at most 8 clauses a value."""
    out: list[_Clause] = []
    for d in range(width - 1, -1, -1):
        follows: dict[int, int] = {}  # prefix (digits above d) -> the digits that follow it
        for k in keys:
            prefix = k >> ((d + 1) * DIGIT_BITS) if d < width - 1 else 0
            follows[prefix] = follows.get(prefix, 0) | 1 << ((k >> (d * DIGIT_BITS)) & 15)
        for prefix, digits in follows.items():
            bits = digits << (base + (d << DIGIT_BITS))
            for e in range(d + 1, width):
                pe = (prefix >> ((e - d - 1) * DIGIT_BITS)) & 15
                bits |= _digit_range(base, e, 0, 15) & ~_digit_range(base, e, pe, pe)
            out.append((bits, ()))
    return out


def _key_ne(base: int, k: int, digits: int = DIGITS) -> _Clause:
    """``key != k``: some digit differs, one clause."""
    bits = 0
    for d in range(digits):
        kd = (k >> (d * DIGIT_BITS)) & 15
        bits |= _digit_range(base, d, 0, 15) & ~_digit_range(base, d, kd, kd)
    return (bits, ())


Virtual = Callable[[Clause], int | None]
"""A clause -> the first of its two virtual bits (``b``: it holds, ``b + 1``: it does not), or
None to compile it from the signature's own bits (``retrieval/filter_verify.py``)."""


class _Lowering:
    def __init__(self, schema: FilterSchema, max_clauses: int, virtual: Virtual | None = None):
        self.schema, self.max_clauses, self.virtual = schema, max_clauses, virtual

    def cnf(self, e: Expr, neg: bool) -> list[_Clause]:
        """``e`` (its negation when ``neg``) as clauses; ``[]`` is true, ``[_FALSE]`` false."""
        if isinstance(e, Not):
            return self.cnf(e.child, not neg)
        if isinstance(e, And | Or):
            parts = [self.cnf(c, neg) for c in e.children]
            if isinstance(e, And) != neg:
                return self.check([c for p in parts for c in p])
            return self.product(parts)
        if isinstance(e, Compare):
            return self.compare(e, neg)
        return self.clause(e, neg)

    def check(self, clauses: list[_Clause]) -> list[_Clause]:
        if len(clauses) > self.max_clauses:
            raise FilterTooLargeError(
                f"filter: compiles to more than {self.max_clauses} clauses "
                "(each 'or' multiplies the clauses of its sides)",
                "max_compiled_clauses",
            )
        return list(dict.fromkeys(clauses))

    def product(self, parts: list[list[_Clause]]) -> list[_Clause]:
        """The disjunction of CNFs: every choice of one clause per part, ORed together."""
        out: list[_Clause] = [_FALSE]
        for p in parts:
            if not p:
                return []  # one side always holds
            self.check([_FALSE] * (len(out) * len(p)))
            out = self.check([(a[0] | b[0], a[1] + b[1]) for a in out for b in p])
        return out

    def numeric_base(self, attr: str, what: str) -> int:
        base = self.schema.numeric_base.get(attr)
        if base is None:
            self.schema.known(attr)
            raise ValueError(f"filter: {what}: {attr!r} is not a numeric attribute")
        return base

    def compare(self, e: Compare, neg: bool) -> list[_Clause]:
        base = self.numeric_base(e.attribute, f"{e.attribute} {e.op} {e.bound:g}")
        op = {"<": ">=", "<=": ">", ">": "<=", ">=": "<"}[e.op] if neg else e.op
        k = _bound_key(e.bound)
        if op == "<":
            return _key_le(base, k - 1) if k > 0 else [_FALSE]
        if op == ">":
            return _key_ge(base, k + 1) if k < 0xFFFFFFFF else [_FALSE]
        return _key_le(base, k) if op == "<=" else _key_ge(base, k)

    def clause(self, c: Clause, neg: bool) -> list[_Clause]:
        negate = neg != c.negate
        bit = None if self.virtual is None else self.virtual(c)
        if bit is not None:  # its truth given as a bit and its negation as the next: positive
            return [(1 << (bit + negate), ())]
        if c.attribute in self.schema.numeric_base:
            return self.numeric_set(c, negate)
        if (hashed := self.schema.hashed(c)) is not None:
            return self.hashed_set(*hashed, negate)
        bits = 0
        for b in self.schema.clause_bits(c):
            bits |= 1 << b
        if not negate:
            return [(bits, ())]
        vals = ", ".join(c.values)
        shown = (
            f"{c.attribute} != {vals}" if len(c.values) == 1 else f"{c.attribute} not in {{{vals}}}"
        )
        return [(0, ((bits, shown),))]

    def hashed_set(self, base: int, digits: int, keys: list[int], negate: bool) -> list[_Clause]:
        """A hashed attribute's ``in {values}`` (``not in`` when ``negate``), ``keys`` the
        values' positions (a value no item was given is left out): the digit tests of a
        numeric set, exact since an item holds one value, so ``!=`` joins an ``or`` too."""
        if negate:
            return self.check([_key_ne(base, k, digits) for k in dict.fromkeys(keys)])
        return self.check(_key_in(base, keys, digits)) if keys else [_FALSE]

    def numeric_set(self, c: Clause, negate: bool) -> list[_Clause]:
        """``attr in {numbers}`` (``not in`` when ``negate``)."""
        base = self.schema.numeric_base[c.attribute]
        keys = []
        for v in c.values:
            try:
                x = float(v)
            except ValueError:
                raise ValueError(f"filter: {c.attribute} = {v!r}: expected a number") from None
            keys.append(_bound_key(x))
        if negate:
            return self.check([_key_ne(base, k) for k in dict.fromkeys(keys)])
        return self.check(_key_in(base, keys)) if keys else [_FALSE]


def lower(
    schema: FilterSchema,
    e: Expr,
    max_clauses: int = MAX_COMPILED_CLAUSES,
    virtual: Virtual | None = None,
) -> list[tuple[int, bool, int]]:
    """``e`` -> its clauses as ``(bits, negate, none_bits)`` (bit sets as ints): the clause
    holds when the item has any of ``bits`` (none of them when ``negate``), or, when
    ``none_bits`` is set, none of ``none_bits`` -- an ``or`` of positive predicates and at most
    one negated category ("a != x or b = y"). ``ValueError`` names a second negated category
    in one ``or`` (its test would need a mask per negation), an unknown name or value;
    :class:`FilterTooLargeError` past ``max_clauses``. ``virtual``: the clauses read as
    virtual bits past the signature's (``Virtual``), their own bits never read."""
    out: list[tuple[int, bool, int]] = []
    for pos, parts in _Lowering(schema, max_clauses, virtual).cnf(e, False):
        nones = dict(parts)  # bits -> text: the same negation twice is one
        if not nones:
            out.append((pos, False, 0))
        elif 0 in nones:
            continue  # "none of no bits" always holds: so does the clause
        elif len(nones) > 1:
            shown = list(nones.values())
            raise ValueError(
                f"filter: {shown[0]!r} and {shown[1]!r} are both negated inside one 'or'; "
                "a clause may hold one negated category (for a one-value attribute write "
                "NAME in {the other values})"
            )
        elif pos == 0:
            out.append((next(iter(nones)), True, 0))
        else:
            out.append((pos, False, next(iter(nones))))
    return out


def packed(
    clauses: list[tuple[int, bool, int]], words: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`lower`'s clauses over ``words`` 64-bit words -> ``(masks [C, W] int64, negate [C]
    bool, neg_masks [C, W] int64)``: bit ``b`` of a set is bit ``b % 64`` of word ``b // 64``."""
    masks = np.zeros((len(clauses), words), dtype=np.uint64)
    neg = np.zeros_like(masks)
    for c, (bits, _, none) in enumerate(clauses):
        for w in range(words):
            masks[c, w] = (bits >> (w * 64)) & 0xFFFFFFFFFFFFFFFF
            neg[c, w] = (none >> (w * 64)) & 0xFFFFFFFFFFFFFFFF
    negate = np.array([n for _, n, _ in clauses], dtype=bool)
    return masks.view(np.int64), negate, neg.view(np.int64)
