"""Eligibility filters as tensors: one bit per (attribute, value), clauses as bit masks.

Every item carries a signature ``sig [N, W] int64``: bit ``b`` is set when the item has the
(attribute, value) that :class:`FilterSchema` assigned to ``b``. A request's filter is a conjunction
of clauses, each "the item has one of these values of this attribute" (optionally negated), and is
compiled to ``masks [B, C, W] int64`` and ``negate [B, C] bool``: clause ``c`` holds for an item when
``(sig & masks[:, c]) != 0`` differs from ``negate[:, c]``, or when its row of ``neg_masks [B, C,
W]`` (None: all zero) is set and ``(sig & neg_masks[:, c]) == 0``: "a != x or b = y" on a
multi-valued ``a``. The same tensors drive the in-scan filter of the IVF kernel and the exact
fallback, so both apply the same rule.

Filter text (parsed by :func:`parse_filter`, grammar in ``retrieval/filter_expr.py``; compiled to
those clauses by ``retrieval/filter_cnf.py``)::

    language in {en, fr} and available and not category = adult and region != "south america"
    (genre = comedy or creator in {c1, c2}) and language = en and price < 20

Single- and multi-valued attributes work alike (a multi-valued item simply has several bits set).
A numeric attribute (vocabulary :data:`NUMERIC`) holds one number an item, compared with ``<``,
``<=``, ``>``, ``>=``, ``between``, ``=``, ``!=``, ``in``: its value's bits make every
comparison exact (``retrieval/filter_cnf.py``).

An attribute with many values (creators, stores: ``hashed_min_values`` and more, an
``IVFConfig`` setting) is **hashed**: one value an item, stored as its value's position ``p``
(its place in the vocabulary) in ``D`` hexadecimal digits, each one-hot in 16 bits, so ``16 D``
bits an item whatever the vocabulary (10^6 values: ``D = 6``, 96 bits, where one bit a value
would take 10^6). It is a partitioned Bloom signature whose ``D`` hash functions are the digits
of ``p``: since distinct values differ in some digit, an item holding one value passes
``creator in {a, b}`` only when it holds ``a`` or ``b``: false-positive rate 0, so no
verification pass. ``in`` / ``=`` compile as a numeric set does (a clause per digit prefix the
values share: ``D`` clauses for one value), ``!=`` to one clause of positive bits (so it may sit
inside an ``or``). ``D`` is the fewest digits with ``16**D >= 2 V``: room for as many values
again, which live updates add as they first name them (a new creator takes the next position).
An index lists its items by value, not by digit (a digit's postings hold a 16th of the catalog):
each under its value's bucket, the position modulo ``16**b`` (:func:`bucket_digits`), so
``creator = k`` reads the items of ``k``'s bucket alone and checks them against the clauses
(``retrieval/index/csrc/ivf_scan/values.cpp``).

Values are text. A vocabulary may list integers (``{"label": [0, 1, 2]}``) or booleans: they are
stored as their text (``"3"``, ``"true"``/``"false"``), so ``label = 3`` and ``available`` name
them; other types (floats, ...) are refused at build, since ``1.0`` and ``1`` would read alike.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from retrieval.filter_cnf import (
    DIGIT_BITS,
    NUMERIC_BITS,
    lower,
    numeric_bits,
    numeric_keys,
    packed,
)
from retrieval.filter_expr import And, Clause, Compare, Expr, Not, Or, parse_filter
from retrieval.filter_expr import FilterTooLargeError as FilterTooLargeError
from retrieval.filter_expr import format_filter as format_filter
from retrieval.filter_verify import FilterVerify, OneVerify, batch_verify, compile_verify
from retrieval.value_lists import names_any

WORD_BITS = 64
COMPILED_FILTERS = 4096
"""Distinct filters a :class:`FilterSchema` keeps compiled: served traffic repeats a few texts,
and parsing one costs tens of microseconds a request; past this many the memo starts over."""

AttributeValue = str | int | bool | np.integer | np.bool_
"""A vocabulary entry: text, or an integer / boolean that stands for its text."""
NUMERIC: Literal["numeric"] = "numeric"
"""The vocabulary of a numeric attribute (``{"price": NUMERIC}``): one number an item, float32."""
Vocabulary = Sequence[AttributeValue] | Literal["numeric"]
NO_VALUE = "\x00none"
"""The value a multi-valued hashed attribute's signature gives an item that holds none (no
filter can name it: filter text holds no NUL); its value lists hold nothing for it."""
HASHED_MIN_VALUES = 4096
"""Default ``hashed_min_values`` (``IVFConfig``): from this many values an attribute is hashed
(96 bits or fewer an item, against one a value)."""


def hashed_digits(num_values: int) -> int:
    """Hexadecimal digits ``D`` of a hashed attribute of ``num_values`` values: the fewest with
    ``16**D >= 2 * num_values`` (room for as many new values as the build saw)."""
    d = 1
    while 16**d < 2 * max(num_values, 1):
        d += 1
    return d


def filter_vocabulary(
    item_attributes: Mapping[str, Sequence[AttributeValue]], numeric: Sequence[str] = ()
) -> dict[str, Vocabulary]:
    """What a model's filter schema knows: its item attributes' values, and its numeric
    attributes (``ModelConfig.numeric_attributes``)."""
    out: dict[str, Vocabulary] = dict(item_attributes)
    if clash := set(out) & set(numeric):
        raise ValueError(f"numeric_attributes {sorted(clash)} are item_attributes too")
    out.update({n: NUMERIC for n in numeric})
    return out


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


@dataclass
class FilterBatch:
    """Compiled filters of a batch: ``masks [B, C, W] int64``, ``negate [B, C] bool``, and the
    items each row excludes whatever their attributes, ``exclude [B, S] int64`` item ids (``-1``
    pads; None: none), its user's seen items (``retrieval/index/exclude.py``).

    ``C`` is the largest clause count in the batch; rows with fewer clauses are padded with an
    always-true clause (zero mask, negated). ``neg_masks [B, C, W] int64`` (None when no
    clause has one) is each clause's "or none of these bits" part, zero where it has none.
    ``verify``: the exact clauses of rows naming a multi-valued hashed attribute, whose
    clauses here are a superset test (``retrieval/filter_verify.py``; None: no such row).
    """

    masks: torch.Tensor
    negate: torch.Tensor
    exclude: torch.Tensor | None = None
    neg_masks: torch.Tensor | None = None
    verify: FilterVerify | None = None

    def to(self, device: torch.device | str) -> FilterBatch:
        ex = None if self.exclude is None else self.exclude.to(device)
        nm = None if self.neg_masks is None else self.neg_masks.to(device)
        v = None if self.verify is None else self.verify.to(device)
        return FilterBatch(self.masks.to(device), self.negate.to(device), ex, nm, v)

    def rows(self, rows: torch.Tensor) -> FilterBatch:
        """The filters of rows ``rows [b] int64``."""
        ex = None if self.exclude is None else self.exclude[rows]
        nm = None if self.neg_masks is None else self.neg_masks[rows]
        v = None if self.verify is None else self.verify.take(rows)
        return FilterBatch(self.masks[rows], self.negate[rows], ex, nm, v)

    @property
    def active(self) -> bool:
        """False when no row has a clause (nothing to filter)."""
        return self.masks.shape[1] > 0


def eligible(
    sig: torch.Tensor,
    masks: torch.Tensor,
    negate: torch.Tensor,
    neg_masks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which items pass. ``sig [..., M, W]``, ``masks [..., C, W]``, ``negate [..., C]``,
    ``neg_masks [..., C, W]`` (None: no clause has a negated part) -> ``[..., M] bool``.

    Leading dims broadcast (e.g. ``sig [B, M, W]`` with ``masks [B, C, W]``, or ``sig [M, W]``
    with ``masks [C, W]`` for one request over a whole catalog).
    """
    hit = (sig.unsqueeze(-3) & masks.unsqueeze(-2)).ne(0).any(dim=-1)  # [..., C, M]
    ok = hit.ne(negate.unsqueeze(-1))
    if neg_masks is not None:
        has = neg_masks.ne(0).any(dim=-1, keepdim=True)  # [..., C, 1]
        miss = (sig.unsqueeze(-3) & neg_masks.unsqueeze(-2)).eq(0).all(dim=-1)  # [..., C, M]
        ok = ok | (has & miss)
    return ok.all(dim=-2)


def hashed_keys(positions: np.ndarray, digits: int) -> np.ndarray:
    """Positions ``[n]`` -> their keys ``[n] uint32``: the hexadecimal digits reversed, so the
    key's top digits, which the first clauses of every ``in`` test alone, are the position's
    lowest (spread evenly over the values: the bucket its postings list an item under,
    :func:`bucket_digits`)."""
    p = np.asarray(positions).astype(np.uint32)
    key = np.zeros_like(p)
    for d in range(digits):
        key |= ((p >> np.uint32(DIGIT_BITS * d)) & np.uint32(15)) << np.uint32(
            DIGIT_BITS * (digits - 1 - d)
        )
    return key


def bucket_digits(digits: int, items: int) -> int:
    """Key digits ``b`` a hashed attribute of ``digits`` lists an index's ``items`` by (its
    values' postings, ``retrieval/index/csrc/ivf_scan/values.cpp``): ``16**b`` buckets, the
    position modulo ``16**b``; at most ``digits - 2`` (8 to 128 of the values the build saw a
    bucket: ``16**D``, the room for twice them, is under 16 times as many), and at least 4
    items a bucket on average, so their offsets (8 bytes a bucket) cost at most 2 bytes an item."""
    by_items = 0
    while 4 * 16 ** (by_items + 1) <= items:
        by_items += 1
    return max(1, min(digits - 2, by_items))


Compiled = tuple[np.ndarray, np.ndarray, np.ndarray, OneVerify | None]
"""One filter compiled: ``(masks [C, W] int64, negate [C], neg_masks [C, W], exact clauses)``."""


class FilterSchema:
    """Assigns one signature bit to every (attribute, value) of the catalog, ``NUMERIC_BITS``
    to every numeric attribute, and ``16 D`` to every hashed one.

    ``hashed_min_values``: vocabularies from this size are hashed (None: none).
    ``hashed_digits``: the hashed attributes and their digits, as a saved schema has them
    (given: exactly these are hashed, whatever the sizes)."""

    def __init__(
        self,
        attribute_values: Mapping[str, Vocabulary],
        hashed_min_values: int | None = HASHED_MIN_VALUES,
        hashed_digits: Mapping[str, int] | None = None,
    ):
        # values as text (see value_text): filters name them, and the schema saves as JSON
        self.attribute_values: dict[str, list[str] | Literal["numeric"]] = {}
        self.bit_of: dict[tuple[str, str], int] = {}
        self.numeric_base: dict[str, int] = {}
        self.hashed_base: dict[str, int] = {}
        self.hashed_digits: dict[str, int] = {}
        self.position: dict[str, dict[str, int]] = {}
        """A hashed attribute's value -> its position (the key its digits encode)."""
        self.multi_valued: set[str] = set()
        """The hashed attributes whose items hold several values (their signatures a superset,
        answers verified against the index's value lists: ``retrieval/value_lists.py``)."""
        bits = 0
        for attr, vocab in attribute_values.items():
            if isinstance(vocab, str):
                if vocab != NUMERIC:
                    raise ValueError(
                        f"attribute_values[{attr!r}] is {vocab!r}: give a list of values, "
                        f"or {NUMERIC!r} for a numeric attribute"
                    )
                self.attribute_values[attr], self.numeric_base[attr] = NUMERIC, bits
                bits += NUMERIC_BITS
                continue
            values = [value_text(attr, v) for v in vocab]
            if len(set(values)) != len(values):
                dup = next(v for v in values if values.count(v) > 1)
                raise ValueError(
                    f"attribute_values[{attr!r}] has duplicate values ({dup!r} twice, "
                    "as text: 1 and '1' are one value)"
                )
            self.attribute_values[attr] = values
            digits = self._hashed_digits(attr, len(values), hashed_min_values, hashed_digits)
            if digits:
                self.hashed_base[attr], self.hashed_digits[attr] = bits, digits
                self.position[attr] = {v: p for p, v in enumerate(values)}
                bits += digits << DIGIT_BITS
                continue
            for v in values:
                self.bit_of[(attr, v)] = bits
                bits += 1
        self.num_bits = bits
        self.num_words = (self.num_bits + WORD_BITS - 1) // WORD_BITS
        # filter -> (masks [C, W], negate [C], neg_masks [C, W], exact clauses or None); the
        # schema changes only by learning a value, which starts the memo afresh
        self._compiled: dict[str | Expr | tuple[Clause, ...], Compiled] = {}

    @staticmethod
    def _hashed_digits(
        attr: str, size: int, min_values: int | None, saved: Mapping[str, int] | None
    ) -> int:
        """The digits of attribute ``attr`` of ``size`` values if it is hashed, else 0."""
        if saved is not None:
            return int(saved.get(attr, 0))
        return hashed_digits(size) if min_values is not None and size >= min_values else 0

    def hashed(self, clause: Clause) -> tuple[int, int, list[int]] | None:
        """``(first bit, digits, positions of the values filters name)`` of a clause on a
        hashed attribute (a value no item was given has none), None for another attribute."""
        base = self.hashed_base.get(clause.attribute)
        if base is None:
            return None
        pos = self.position[clause.attribute]
        digits = self.hashed_digits[clause.attribute]
        keys = [int(hashed_keys(np.array([pos[v]]), digits)[0]) for v in clause.values if v in pos]
        return base, self.hashed_digits[clause.attribute], keys

    def learn(self, attr: str, value: str, keep: bool = True) -> int:
        """The position of ``value`` of hashed attribute ``attr``, a new one (the next) for a
        value first named here (a live update's new creator), kept unless not ``keep`` (a
        check: the position it would take); ``ValueError`` when the digits hold no more."""
        pos = self.position[attr]
        p = pos.get(value)
        if p is not None:
            return p
        if len(pos) >= 16 ** self.hashed_digits[attr]:
            raise ValueError(f"{attr!r} holds {len(pos)} values, all its digits can")
        vocab = self.attribute_values[attr]
        assert not isinstance(vocab, str)
        if not keep:
            return len(vocab)
        pos[value] = p = len(vocab)
        vocab.append(value)
        # a fresh memo: a filter naming it compiled to "nothing has it" (and one compiling
        # meanwhile stores into the old one)
        self._compiled = {}
        return p

    def hashed_sizes(self) -> dict[str, int]:
        """Each hashed attribute's values now (what :meth:`forget` goes back to)."""
        return {a: len(self.position[a]) for a in self.hashed_base}

    def forget(self, sizes: Mapping[str, int]) -> None:
        """Drops the values learned past ``sizes`` (:meth:`hashed_sizes` before an update that
        was not applied), so the next new value takes the position it would have."""
        for attr, size in sizes.items():
            vocab = self.attribute_values[attr]
            assert not isinstance(vocab, str)
            for v in vocab[size:]:
                del self.position[attr][v]
            del vocab[size:]
        self._compiled = {}

    def unindexed_bits(self, listed_top_digit: bool = False) -> np.ndarray:
        """``[W*64] bool``: the bits no postings list: a hashed attribute's digits, whose
        items its values' postings list instead (:meth:`value_layout`): a digit's postings
        hold a 16th of the catalog, a value's bucket its items. ``listed_top_digit``: the
        layout of an index saved before the values' postings, which listed the key's top
        digit."""
        out = np.zeros(self.num_words * WORD_BITS, dtype=bool)
        for attr, base in self.hashed_base.items():
            out[base : base + ((self.hashed_digits[attr] - listed_top_digit) << DIGIT_BITS)] = True
        return out

    def value_layout(self, items: int) -> torch.Tensor:
        """``[A, 4] int64``, a row per hashed attribute: its first bit, digits ``D``, bucket
        digits (:func:`bucket_digits` for an index of ``items``) and first slot in the
        index's values' postings (each attribute ``16**b`` buckets, then one slot of items
        whose bucket digits are not one-hot: a signature written by hand)."""
        rows, first = [], 0
        for attr, base in self.hashed_base.items():
            d = self.hashed_digits[attr]
            b = bucket_digits(d, items)
            rows.append([base, d, b, first])
            first += 16**b + 1
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)

    def to_dict(self) -> dict[str, list[str] | Literal["numeric"]]:
        return {a: v if isinstance(v, str) else list(v) for a, v in self.attribute_values.items()}

    def vocabulary(self, attr: str) -> list[str]:
        """The values of categorical attribute ``attr`` (``[]`` for a numeric one)."""
        vocab = self.attribute_values[attr]
        return [] if isinstance(vocab, str) else vocab

    def signatures(self, item_attributes: Mapping[str, np.ndarray], num_items: int) -> torch.Tensor:
        """Item attributes -> ``sig [N, W] int64``.

        ``item_attributes[a]`` is either int codes ``[N]`` (single-valued) or bool ``[N, V_a]``
        (multi-valued), with values indexing ``attribute_values[a]``; for a numeric attribute,
        numbers ``[N]`` (stored as float32; NaN refused).
        """
        sig = np.zeros((num_items, max(self.num_words, 0)), dtype=np.uint64)
        rows = np.arange(num_items)
        for attr, arr in item_attributes.items():
            if attr not in self.attribute_values:
                raise ValueError(f"item_attributes[{attr!r}] has no vocabulary in attribute_values")
            if attr in self.hashed_base and isinstance(arr, list | tuple):
                self._multi_hashed_signatures(sig, attr, arr)
                continue
            arr = np.asarray(arr)
            if arr.shape[0] != num_items:
                raise ValueError(
                    f"item_attributes[{attr!r}] has {arr.shape[0]} rows, expected {num_items}"
                )
            if attr in self.numeric_base:
                if arr.ndim != 1:
                    raise ValueError(f"item_attributes[{attr!r}] must be numbers [N]")
                try:
                    bit = numeric_bits(numeric_keys(arr), self.numeric_base[attr])  # [N, 8]
                except ValueError as e:
                    raise ValueError(f"item_attributes[{attr!r}]: {e}") from None
                for col in bit.T:
                    sig[rows, col // WORD_BITS] |= np.uint64(1) << (col % WORD_BITS).astype(
                        np.uint64
                    )
                continue
            vocab = self.vocabulary(attr)
            if attr in self.hashed_base:
                self._hashed_signatures(sig, attr, arr)
                continue
            first = self.bit_of[(attr, vocab[0])]
            if arr.ndim == 1:
                if arr.size and (arr.min() < 0 or arr.max() >= len(vocab)):
                    raise ValueError(
                        f"item_attributes[{attr!r}] has codes outside [0, {len(vocab)})"
                    )
                bit = first + arr.astype(np.int64)  # one bit per item: each row once, no clash
                sig[rows, bit // WORD_BITS] |= np.uint64(1) << (bit % WORD_BITS).astype(np.uint64)
            elif arr.ndim == 2 and arr.shape[1] == len(vocab):
                w0, off = divmod(first, WORD_BITS)  # the block's bits, packed where they land
                span = np.zeros((num_items, -(-(off + len(vocab)) // WORD_BITS) * WORD_BITS), bool)
                span[:, off : off + len(vocab)] = arr.astype(bool)
                packed = pack_bits(span).numpy().view(np.uint64)
                sig[:, w0 : w0 + packed.shape[1]] |= packed
            else:
                raise ValueError(
                    f"item_attributes[{attr!r}] must be codes [N] or bool [N, {len(vocab)}]"
                )
        return torch.from_numpy(sig.view(np.int64))

    def _hashed_signatures(self, sig: np.ndarray, attr: str, codes: np.ndarray) -> None:
        """Sets the digit bits of hashed attribute ``attr``'s codes ``[N]`` in ``sig [N, W]``."""
        size = len(self.vocabulary(attr))
        if codes.ndim != 1:
            raise ValueError(
                f"item_attributes[{attr!r}] is hashed ({size} values, hashed_min_values or "
                "more): one value an item, codes [N]; set hashed_min_values above its size "
                "for one bit a value"
            )
        if codes.size and (codes.min() < 0 or codes.max() >= size):
            raise ValueError(f"item_attributes[{attr!r}] has codes outside [0, {size})")
        digits = self.hashed_digits[attr]
        bit = numeric_bits(hashed_keys(codes, digits), self.hashed_base[attr], digits)
        rows = np.arange(codes.shape[0])
        for col in bit.T:
            sig[rows, col // WORD_BITS] |= np.uint64(1) << (col % WORD_BITS).astype(np.uint64)

    def _multi_hashed_signatures(
        self, sig: np.ndarray, attr: str, lists: Sequence[Sequence[int]]
    ) -> None:
        """Sets, in ``sig [N, W]``, the digit bits of every value of multi-valued hashed
        attribute ``attr`` each item holds (``lists``: each item's codes): a superset test."""
        size = len(self.vocabulary(attr))
        if len(lists) != sig.shape[0]:
            raise ValueError(
                f"item_attributes[{attr!r}] has {len(lists)} rows, expected {len(sig)}"
            )
        flat = [int(c) for v in lists for c in v]
        if flat and (min(flat) < 0 or max(flat) >= size):
            raise ValueError(f"item_attributes[{attr!r}] has codes outside [0, {size})")
        none = self.learn(attr, NO_VALUE)  # an item holding none sets its digits
        lists = [v if len(v) else [none] for v in lists]
        rows = np.repeat(np.arange(len(lists)), [len(v) for v in lists])
        codes = np.fromiter((int(c) for v in lists for c in v), np.int64, rows.shape[0])
        digits = self.hashed_digits[attr]
        bit = numeric_bits(hashed_keys(codes, digits), self.hashed_base[attr], digits)
        for col in bit.T:
            np.bitwise_or.at(
                sig, (rows, col // WORD_BITS), np.uint64(1) << (col % WORD_BITS).astype(np.uint64)
            )
        self.multi_valued.add(attr)

    def value_bits(self, attr: str, values: Sequence[str], learn: bool = True) -> list[int]:
        """The signature bits an item with ``values`` of ``attr`` sets (a numeric attribute:
        one number, as text; a hashed one: one value, a multi-valued hashed one: any number,
        new ones learned unless not ``learn``); ``ValueError`` for an unknown name or value."""
        self.known(attr)
        if attr in self.multi_valued:
            return self.multi_bits(attr, values, learn)
        if attr in self.hashed_base:
            if len(values) != 1:
                raise ValueError(f"{attr!r} is hashed: one value an item")
            p = self.learn(attr, values[0], keep=learn)
            key = hashed_keys(np.array([p]), self.hashed_digits[attr])
            return (
                numeric_bits(key, self.hashed_base[attr], self.hashed_digits[attr]).ravel().tolist()
            )
        if attr in self.numeric_base:
            if len(values) > 1:
                raise ValueError(f"{attr!r} is numeric: one value an item")
            try:
                keys = numeric_keys(np.array([float(v) for v in values]))
            except ValueError:
                raise ValueError(
                    f"{attr!r} is numeric: expected a number, got {values[0]!r}"
                ) from None
            return numeric_bits(keys, self.numeric_base[attr]).ravel().tolist()
        return self.clause_bits(Clause(attr, tuple(values)))

    def multi_bits(self, attr: str, values: Sequence[str], learn: bool = True) -> list[int]:
        """The signature bits an item holding ``values`` of multi-valued hashed attribute
        ``attr`` sets (new values learned unless not ``learn``): every value's digits, or
        :data:`NO_VALUE`'s for none (so that ``!=`` / ``not in``, which test for a digit bit
        other than the named values', pass it: the superset holds for an item with no value
        too)."""
        out: set[int] = set()
        for v in values or [NO_VALUE]:
            p = self.learn(attr, v, keep=learn)
            key = hashed_keys(np.array([p]), self.hashed_digits[attr])
            out.update(numeric_bits(key, self.hashed_base[attr], self.hashed_digits[attr]).ravel())
        return sorted(int(b) for b in out)

    def attribute_bits(self, attr: str) -> list[int]:
        """Every signature bit attribute ``attr`` may set."""
        if attr in self.numeric_base:
            return list(range(self.numeric_base[attr], self.numeric_base[attr] + NUMERIC_BITS))
        if attr in self.hashed_base:
            base = self.hashed_base[attr]
            return list(range(base, base + (self.hashed_digits[attr] << DIGIT_BITS)))
        return [self.bit_of[(attr, v)] for v in self.vocabulary(attr)]

    def known(self, attr: str) -> None:
        """``ValueError`` naming the known attributes unless ``attr`` is one."""
        if attr not in self.attribute_values:
            known = ", ".join(sorted(self.attribute_values)) or "none"
            raise ValueError(f"filter: unknown attribute {attr!r} (known: {known})")

    def clause_bits(self, clause: Clause) -> list[int]:
        """The bits of a categorical clause's values; unknown names raise ``ValueError``."""
        self.known(clause.attribute)
        out = []
        for v in clause.values:
            bit = self.bit_of.get((clause.attribute, v))
            if bit is None:
                raise ValueError(f"filter: unknown value {v!r} for attribute {clause.attribute!r}")
            out.append(bit)
        return out

    def clause_mask(self, clause: Clause) -> np.ndarray:
        """``[W] int64`` mask of a categorical clause's values; unknown names raise ``ValueError``."""
        bits = np.zeros(self.num_words * WORD_BITS, dtype=bool)
        bits[self.clause_bits(clause)] = True
        return pack_bits(bits[None, :])[0].numpy()

    def check(self, f: str | Expr | Sequence[Clause]) -> None:
        """``ValueError`` unless filter ``f`` compiles here (unknown names, a negated category
        inside an 'or', too many clauses); what compiles is kept for :meth:`compile`."""
        self._compile_one(_filter_key(f))

    def compile(self, filters: Sequence[str | Expr | Sequence[Clause] | None]) -> FilterBatch:
        """One filter per request (text, parsed expression or clauses, or None) ->
        :class:`FilterBatch`.

        Each distinct filter is parsed and compiled once and kept (up to
        ``COMPILED_FILTERS`` of them: parsing costs tens of microseconds a filter, and served
        requests repeat a few texts), then copied to its rows.
        """
        if not any(filters):  # no request filters (the common batch): nothing to compile
            return self.empty(len(filters))
        row_of: dict[str | Expr | tuple[Clause, ...], int] = {}
        rows = [row_of.setdefault(_filter_key(f), len(row_of)) for f in filters]  # [B]
        compiled = [self._compile_one(key) for key in row_of]
        c_max = max((len(c[1]) for c in compiled), default=0)
        masks = np.zeros((len(compiled), c_max, self.num_words), dtype=np.int64)
        negate = np.ones((len(compiled), c_max), dtype=bool)  # padding: "not (nothing)" is true
        neg = np.zeros_like(masks)  # padding and most clauses: no negated part
        for u, (m, n, g, _) in enumerate(compiled):
            masks[u, : len(n)], negate[u, : len(n)], neg[u, : len(n)] = m, n, g
        take = np.asarray(rows, dtype=np.int64)
        nm = torch.from_numpy(neg[take]) if neg.any() else None
        verify = batch_verify([c[3] for c in compiled], take)
        return FilterBatch(
            torch.from_numpy(masks[take]), torch.from_numpy(negate[take]), None, nm, verify
        )

    def _compile_one(self, key: str | Expr | tuple[Clause, ...]) -> Compiled:
        """One filter -> ``(masks [C, W] int64, negate [C] bool, neg_masks [C, W] int64, its
        exact clauses or None)``, kept: the exact clauses where it names a multi-valued
        hashed attribute (``retrieval/filter_verify.py``)."""
        memo = self._compiled  # learning a value starts another
        hit = memo.get(key)
        if hit is not None:
            return hit
        if isinstance(key, str):
            expr: Expr = parse_filter(key)
        elif isinstance(key, tuple):
            expr = And(key)
        else:
            expr = key
        masks, negate, neg = packed(lower(self, expr), self.num_words)
        verify = None
        if self.multi_valued and names_any(expr, self.multi_valued) is not None:
            multi = sorted(self.multi_valued)
            verify = compile_verify(self, expr, self.num_words, multi, self.position)
        out = (masks, negate, neg, verify)
        if len(memo) >= COMPILED_FILTERS:
            memo.clear()  # bounded; a served mix refills the texts it uses
        memo[key] = out
        return out

    def empty(self, batch: int) -> FilterBatch:
        """A batch with no clauses (everything eligible)."""
        return FilterBatch(
            torch.zeros(batch, 0, self.num_words, dtype=torch.int64),
            torch.zeros(batch, 0, dtype=torch.bool),
        )


def _filter_key(f: str | Expr | Sequence[Clause] | None) -> str | Expr | tuple[Clause, ...]:
    """A hashable key for one request's filter: its text, its expression, or its clauses
    (None: no clauses)."""
    if isinstance(f, str):  # the served case first: one type check
        return f
    if isinstance(f, Clause | Compare | Not | And | Or):
        return f
    return tuple(f or ())


def pack_bits(bits: np.ndarray) -> torch.Tensor:
    """``bool [M, W*64]`` -> ``int64 [M, W]`` (bit j of word w is column w*64 + j)."""
    m, words = bits.shape[0], bits.shape[1] // WORD_BITS
    packed = np.packbits(np.ascontiguousarray(bits, dtype=bool), axis=1, bitorder="little")
    return torch.from_numpy(packed.view("<u8").astype(np.uint64).view(np.int64).reshape(m, words))
