"""Eligibility filters as tensors: one bit per (attribute, value), clauses as bit masks.

Every item carries a signature ``sig [N, W] int64``: bit ``b`` is set when the item has the
(attribute, value) that :class:`FilterSchema` assigned to ``b``. A request's filter is a conjunction
of clauses, each "the item has one of these values of this attribute" (optionally negated), and is
compiled to ``masks [B, C, W] int64`` and ``negate [B, C] bool``: clause ``c`` holds for an item when
``(sig & masks[:, c]) != 0`` differs from ``negate[:, c]``. The same tensors drive the in-scan
filter of the IVF kernel and the exact fallback, so both apply the same rule.

Filter text (parsed by :func:`parse_filter`)::

    language in {en, fr} and available and not category = adult and region != "south america"

Single- and multi-valued attributes work alike (a multi-valued item simply has several bits set).

Values are text. A vocabulary may list integers (``{"label": [0, 1, 2]}``) or booleans: they are
stored as their text (``"3"``, ``"true"``/``"false"``), so ``label = 3`` and ``available`` name
them; other types (floats, ...) are refused at build, since ``1.0`` and ``1`` would read alike.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

WORD_BITS = 64
COMPILED_FILTERS = 4096
"""Distinct filters a :class:`FilterSchema` keeps compiled: served traffic repeats a few texts,
and parsing one costs tens of microseconds a request; past this many the memo starts over."""

AttributeValue = str | int | bool | np.integer | np.bool_
"""A vocabulary entry: text, or an integer / boolean that stands for its text."""


def value_text(attribute: str, value: AttributeValue) -> str:
    """The text by which filters name ``value`` of ``attribute``: a string as it is, a boolean
    as ``"true"``/``"false"``, an integer in decimal (``3`` -> ``"3"``); anything else is refused
    (``ValueError`` naming the attribute)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | np.bool_):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    raise ValueError(
        f"attribute_values[{attribute!r}]: {value!r} is a {type(value).__name__}; give strings "
        f"or integers (e.g. str(v), and name that text in filters)"
    )


@dataclass(frozen=True)
class Clause:
    """The item has one of ``values`` of ``attribute`` (or, when ``negate``, none of them)."""

    attribute: str
    values: tuple[str, ...]
    negate: bool = False


class FilterTooLargeError(ValueError):
    """A filter past a limit given to :func:`parse_filter` (``limit``: the argument's name)."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


_TOKEN = re.compile(
    r"""\s*(?:(?P<str>"[^"]*"|'[^']*')|(?P<op>==|!=|=|\{|\}|,)|(?P<word>[A-Za-z0-9_.+\-:/]+))"""
)
_CHAR_HINTS = {
    "&": "clauses join with 'and'",
    "|": "'or' is not supported: for one attribute write NAME in {A, B}",
    "[": "write a set in braces: NAME in {A, B}",
    "(": "parentheses are not supported: a filter is clauses joined with 'and'",
    "!": "write NAME != VALUE, or not NAME",
    "<": "comparisons are not supported: list the values, NAME in {A, B}",
    ">": "comparisons are not supported: list the values, NAME in {A, B}",
}


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            char = text[pos:].strip()[:1]
            hint = f" ({_CHAR_HINTS[char]})" if char in _CHAR_HINTS else ""
            raise ValueError(f"filter: unexpected character {char!r} at {pos}{hint}")
        kind = m.lastgroup or ""
        value = m.group(kind)
        out.append(("word", value[1:-1]) if kind == "str" else (kind, value))
        pos = m.end()
    return out


def parse_filter(
    text: str, *, max_clauses: int | None = None, max_values: int | None = None
) -> list[Clause]:
    """Parses ``clause (and clause)*`` where a clause is one of::

        [not] NAME                    boolean attribute is "true" (NAME = true)
        [not] NAME = VALUE | NAME != VALUE
        [not] NAME [not] in {V1, V2, ...}

    Values may be quoted ("..." or '...'). Raises ``ValueError`` naming the offending token,
    or :class:`FilterTooLargeError` at the first clause past ``max_clauses`` or value past
    ``max_values`` in one set (so the work done is bounded by the limits, not the text).
    """
    toks = _tokens(text)
    clauses: list[Clause] = []
    i = 0

    def peek(k: int = 0) -> tuple[str, str] | None:
        return toks[i + k] if i + k < len(toks) else None

    def is_word(t: tuple[str, str] | None, w: str) -> bool:
        return t is not None and t[0] == "word" and t[1].lower() == w

    while i < len(toks):
        negate = False
        while is_word(peek(), "not"):
            negate, i = not negate, i + 1
        name = peek()
        if name is None or name[0] != "word":
            raise ValueError(
                f"filter: expected an attribute name, got {name[1] if name else 'end of text'!r}"
            )
        attr, i = name[1], i + 1
        nxt = peek()
        if nxt is None or is_word(nxt, "and"):
            values: tuple[str, ...] = ("true",)
        elif nxt == ("op", "=="):
            val = peek(1)
            shown = val[1] if val is not None and val[0] == "word" else "VALUE"
            raise ValueError(f"filter: write '{attr} = {shown}' (one '='), not '{attr} == {shown}'")
        elif nxt[0] == "op" and nxt[1] in ("=", "!="):
            val = peek(1)
            if val is None or val[0] != "word":
                raise ValueError(f"filter: expected a value after {attr} {nxt[1]}")
            values, negate, i = (val[1],), negate ^ (nxt[1] == "!="), i + 2
        elif is_word(nxt, "in") or (is_word(nxt, "not") and is_word(peek(1), "in")):
            if is_word(nxt, "not"):
                negate, i = not negate, i + 1
            i += 1
            if peek() != ("op", "{"):
                raise ValueError(f"filter: expected '{{' after {attr} in")
            i += 1
            vals: list[str] = []
            while True:
                t = peek()
                if t is None or t[0] != "word":
                    raise ValueError(f"filter: expected a value in the set of {attr}")
                vals.append(t[1])
                if max_values is not None and len(vals) > max_values:
                    raise FilterTooLargeError(
                        f"filter: the set of {attr} holds more than {max_values} values",
                        "max_values",
                    )
                i += 1
                sep = peek()
                if sep == ("op", "}"):
                    i += 1
                    break
                if sep != ("op", ","):
                    raise ValueError(f"filter: expected ',' or '}}' in the set of {attr}")
                i += 1
            values = tuple(vals)
        else:
            raise ValueError(f"filter: unexpected {nxt[1]!r} after attribute {attr!r}")
        clauses.append(Clause(attr, values, negate))
        if max_clauses is not None and len(clauses) > max_clauses:
            raise FilterTooLargeError(f"filter: more than {max_clauses} clauses", "max_clauses")
        if i < len(toks):
            if not is_word(peek(), "and"):
                hint = (
                    " ('or' is not supported: for one attribute write NAME in {A, B})"
                    if is_word(peek(), "or")
                    else ""
                )
                raise ValueError(f"filter: expected 'and', got {toks[i][1]!r}{hint}")
            i += 1
            if i == len(toks):
                raise ValueError("filter: dangling 'and' at the end")
    return clauses


def format_filter(clauses: Sequence[Clause]) -> str:
    """Inverse of :func:`parse_filter` (values are always quoted)."""
    parts = []
    for c in clauses:
        vals = ", ".join('"' + v + '"' for v in c.values)
        parts.append(("not " if c.negate else "") + f"{c.attribute} in {{{vals}}}")
    return " and ".join(parts)


@dataclass
class FilterBatch:
    """Compiled filters of a batch: ``masks [B, C, W] int64``, ``negate [B, C] bool``, and the
    items each row excludes whatever their attributes, ``exclude [B, S] int64`` item ids (``-1``
    pads; None: none), its user's seen items (``retrieval/index/exclude.py``).

    ``C`` is the largest clause count in the batch; rows with fewer clauses are padded with an
    always-true clause (zero mask, negated).
    """

    masks: torch.Tensor
    negate: torch.Tensor
    exclude: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> FilterBatch:
        ex = None if self.exclude is None else self.exclude.to(device)
        return FilterBatch(self.masks.to(device), self.negate.to(device), ex)

    def rows(self, rows: torch.Tensor) -> FilterBatch:
        """The filters of rows ``rows [b] int64``."""
        ex = None if self.exclude is None else self.exclude[rows]
        return FilterBatch(self.masks[rows], self.negate[rows], ex)

    @property
    def active(self) -> bool:
        """False when no row has a clause (nothing to filter)."""
        return self.masks.shape[1] > 0


def eligible(sig: torch.Tensor, masks: torch.Tensor, negate: torch.Tensor) -> torch.Tensor:
    """Which items pass. ``sig [..., M, W]``, ``masks [..., C, W]``, ``negate [..., C]`` -> ``[..., M] bool``.

    Leading dims broadcast (e.g. ``sig [B, M, W]`` with ``masks [B, C, W]``, or ``sig [M, W]``
    with ``masks [C, W]`` for one request over a whole catalog).
    """
    hit = (sig.unsqueeze(-3) & masks.unsqueeze(-2)).ne(0).any(dim=-1)  # [..., C, M]
    return hit.ne(negate.unsqueeze(-1)).all(dim=-2)


class FilterSchema:
    """Assigns one signature bit to every (attribute, value) of the catalog."""

    def __init__(self, attribute_values: Mapping[str, Sequence[AttributeValue]]):
        # values as text (see value_text): filters name them, and the schema saves as JSON
        self.attribute_values: dict[str, list[str]] = {
            a: [value_text(a, v) for v in vals] for a, vals in attribute_values.items()
        }
        self.bit_of: dict[tuple[str, str], int] = {}
        for attr, values in self.attribute_values.items():
            if len(set(values)) != len(values):
                dup = next(v for v in values if values.count(v) > 1)
                raise ValueError(
                    f"attribute_values[{attr!r}] has duplicate values ({dup!r} twice, "
                    "as text: 1 and '1' are one value)"
                )
            for v in values:
                self.bit_of[(attr, v)] = len(self.bit_of)
        self.num_bits = len(self.bit_of)
        self.num_words = (self.num_bits + WORD_BITS - 1) // WORD_BITS
        # filter -> (masks [C, W], negate [C]); the schema never changes, so neither do they
        self._compiled: dict[str | tuple[Clause, ...], tuple[np.ndarray, np.ndarray]] = {}

    def to_dict(self) -> dict[str, list[str]]:
        return {a: list(v) for a, v in self.attribute_values.items()}

    def signatures(self, item_attributes: Mapping[str, np.ndarray], num_items: int) -> torch.Tensor:
        """Item attributes -> ``sig [N, W] int64``.

        ``item_attributes[a]`` is either int codes ``[N]`` (single-valued) or bool ``[N, V_a]``
        (multi-valued), with values indexing ``attribute_values[a]``.
        """
        sig = np.zeros((num_items, max(self.num_words, 0)), dtype=np.uint64)
        rows = np.arange(num_items)
        for attr, arr in item_attributes.items():
            if attr not in self.attribute_values:
                raise ValueError(f"item_attributes[{attr!r}] has no vocabulary in attribute_values")
            first = self.bit_of[(attr, self.attribute_values[attr][0])]
            vocab = len(self.attribute_values[attr])
            arr = np.asarray(arr)
            if arr.shape[0] != num_items:
                raise ValueError(
                    f"item_attributes[{attr!r}] has {arr.shape[0]} rows, expected {num_items}"
                )
            if arr.ndim == 1:
                if arr.size and (arr.min() < 0 or arr.max() >= vocab):
                    raise ValueError(f"item_attributes[{attr!r}] has codes outside [0, {vocab})")
                bit = first + arr.astype(np.int64)  # one bit per item: each row once, no clash
                sig[rows, bit // WORD_BITS] |= np.uint64(1) << (bit % WORD_BITS).astype(np.uint64)
            elif arr.ndim == 2 and arr.shape[1] == vocab:
                w0, off = divmod(first, WORD_BITS)  # the block's bits, packed where they land
                span = np.zeros((num_items, -(-(off + vocab) // WORD_BITS) * WORD_BITS), bool)
                span[:, off : off + vocab] = arr.astype(bool)
                packed = pack_bits(span).numpy().view(np.uint64)
                sig[:, w0 : w0 + packed.shape[1]] |= packed
            else:
                raise ValueError(
                    f"item_attributes[{attr!r}] must be codes [N] or bool [N, {vocab}]"
                )
        return torch.from_numpy(sig.view(np.int64))

    def clause_mask(self, clause: Clause) -> np.ndarray:
        """``[W] int64`` mask of a clause's values; unknown names raise ``ValueError``."""
        if clause.attribute not in self.attribute_values:
            known = ", ".join(sorted(self.attribute_values)) or "none"
            raise ValueError(f"filter: unknown attribute {clause.attribute!r} (known: {known})")
        bits = np.zeros(self.num_words * WORD_BITS, dtype=bool)
        for v in clause.values:
            bit = self.bit_of.get((clause.attribute, v))
            if bit is None:
                raise ValueError(f"filter: unknown value {v!r} for attribute {clause.attribute!r}")
            bits[bit] = True
        return pack_bits(bits[None, :])[0].numpy()

    def compile(self, filters: Sequence[str | Sequence[Clause] | None]) -> FilterBatch:
        """One filter per request (text, parsed clauses, or None) -> :class:`FilterBatch`.

        Each distinct filter is parsed and compiled once and kept (up to
        ``COMPILED_FILTERS`` of them: parsing costs tens of microseconds a filter, and served
        requests repeat a few texts), then copied to its rows.
        """
        if not any(filters):  # no request filters (the common batch): nothing to compile
            return self.empty(len(filters))
        row_of: dict[str | tuple[Clause, ...], int] = {}
        rows = [row_of.setdefault(_filter_key(f), len(row_of)) for f in filters]  # [B]
        compiled = [self._compile_one(key) for key in row_of]
        c_max = max((len(n) for _, n in compiled), default=0)
        masks = np.zeros((len(compiled), c_max, self.num_words), dtype=np.int64)
        negate = np.ones((len(compiled), c_max), dtype=bool)  # padding: "not (nothing)" is true
        for u, (m, n) in enumerate(compiled):
            masks[u, : len(n)], negate[u, : len(n)] = m, n
        take = np.asarray(rows, dtype=np.int64)
        return FilterBatch(torch.from_numpy(masks[take]), torch.from_numpy(negate[take]))

    def _compile_one(self, key: str | tuple[Clause, ...]) -> tuple[np.ndarray, np.ndarray]:
        """One filter (text or clauses) -> ``(masks [C, W] int64, negate [C] bool)``, kept."""
        hit = self._compiled.get(key)
        if hit is not None:
            return hit
        clauses = parse_filter(key) if isinstance(key, str) else key
        masks = np.zeros((len(clauses), self.num_words), dtype=np.int64)
        for c, clause in enumerate(clauses):
            masks[c] = self.clause_mask(clause)
        out = (masks, np.array([c.negate for c in clauses], dtype=bool))
        if len(self._compiled) >= COMPILED_FILTERS:
            self._compiled.clear()  # bounded; a served mix refills the texts it uses
        self._compiled[key] = out
        return out

    def empty(self, batch: int) -> FilterBatch:
        """A batch with no clauses (everything eligible)."""
        return FilterBatch(
            torch.zeros(batch, 0, self.num_words, dtype=torch.int64),
            torch.zeros(batch, 0, dtype=torch.bool),
        )


def _filter_key(f: str | Sequence[Clause] | None) -> str | tuple[Clause, ...]:
    """A hashable key for one request's filter: its text, or its clauses (None: no clauses)."""
    return f if isinstance(f, str) else tuple(f or ())


def pack_bits(bits: np.ndarray) -> torch.Tensor:
    """``bool [M, W*64]`` -> ``int64 [M, W]`` (bit j of word w is column w*64 + j)."""
    m, words = bits.shape[0], bits.shape[1] // WORD_BITS
    packed = np.packbits(np.ascontiguousarray(bits, dtype=bool), axis=1, bitorder="little")
    return torch.from_numpy(packed.view("<u8").astype(np.uint64).view(np.int64).reshape(m, words))


def estimate_selectivity(fb: FilterBatch, counts: torch.Tensor, num_items: int) -> torch.Tensor:
    """Fraction of items each request admits, assuming clauses are independent -> ``[B] float32``.

    A clause's fraction is the summed frequency of its bits (capped at 1; exact for single-valued
    attributes), complemented when negated. Used only to plan the search; correctness never
    depends on it.
    """
    if not fb.active:
        return torch.ones(fb.masks.shape[0])
    # NumPy on the host, where planning runs: for one row, a handful of torch ops cost more in
    # dispatch than the work
    masks, negate = fb.masks.cpu().numpy(), fb.negate.cpu().numpy()
    b, c = masks.shape[:2]
    as_bytes = np.ascontiguousarray(masks).view(np.uint8).reshape(b, c, -1)  # little-endian words
    bits = np.unpackbits(as_bytes, axis=2, bitorder="little")  # [B, C, W*64]
    per_bit = counts.cpu().numpy().astype(np.float64) / max(num_items, 1)
    frac = np.minimum(bits @ per_bit, 1.0)  # [B, C]
    frac = np.where(negate, 1.0 - frac, frac)
    return torch.from_numpy(frac.prod(axis=1).astype(np.float32))
