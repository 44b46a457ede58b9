"""Filter text -> an expression tree (no schema needed: names are checked when it compiles).

Grammar (keywords case-insensitive; values may be quoted, "..." or '...')::

    expr  := term ("or" term)*
    term  := unary ("and" unary)*
    unary := "not" unary | "(" expr ")" | pred
    pred  := NAME                                   boolean attribute: NAME = true
           | NAME ("=" | "!=") VALUE
           | NAME ["not"] "in" "{" VALUE ("," VALUE)* "}"
           | NAME ("<" | "<=" | ">" | ">=") NUMBER
           | NAME ["not"] "between" NUMBER "and" NUMBER   (both ends included)

``and`` binds tighter than ``or``; ``not`` tighter than both. A conjunction of the old form
(``language in {en, fr} and not category = adult``) reads as it always did.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MAX_DEPTH = 32
"""Nesting (parentheses and ``not``) a filter may hold: the parser recurses once a level."""


@dataclass(frozen=True)
class Clause:
    """The item has one of ``values`` of ``attribute`` (or, when ``negate``, none of them).
    On a numeric attribute: its number equals one of ``values`` (read as numbers)."""

    attribute: str
    values: tuple[str, ...]
    negate: bool = False


@dataclass(frozen=True)
class Compare:
    """A numeric attribute's value against ``bound``: ``op`` one of ``<``, ``<=``, ``>``, ``>=``."""

    attribute: str
    op: str
    bound: float


@dataclass(frozen=True)
class Not:
    """The item fails ``child``."""

    child: Expr


@dataclass(frozen=True)
class And:
    """The item passes every child."""

    children: tuple[Expr, ...]


@dataclass(frozen=True)
class Or:
    """The item passes some child."""

    children: tuple[Expr, ...]


Expr = Clause | Compare | Not | And | Or
"""A parsed filter (frozen: it keys the compiled-filter memo)."""


class FilterTooLargeError(ValueError):
    """A filter past a limit given to :func:`parse_filter` (``limit``: the argument's name)."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


_TOKEN = re.compile(
    r"""\s*(?:(?P<str>"[^"]*"|'[^']*')|(?P<op>==|!=|<=|>=|=|<|>|\{|\}|,|\(|\))"""
    r"""|(?P<word>[A-Za-z0-9_.+\-:/]+))"""
)
_CHAR_HINTS = {
    "&": "conditions join with 'and'",
    "|": "alternatives join with 'or'",
    "[": "write a set in braces: NAME in {A, B}",
    "!": "write NAME != VALUE, or not NAME",
}
_KEYWORDS = frozenset({"and", "or", "not", "in", "between"})


def _tokens(text: str) -> list[tuple[str, str, int]]:
    """``(kind, text, offset)`` per token; kind is ``word`` (quoted values too), ``op`` or ``str``."""
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
        start = m.start(kind)
        out.append(("str", value[1:-1], start) if kind == "str" else (kind, value, start))
        pos = m.end()
    return out


class _Parser:
    """Recursive descent over the tokens, counting predicates and set values as it goes, so the
    work is bounded by the limits whatever the text."""

    def __init__(self, text: str, max_clauses: int | None, max_values: int | None):
        self.toks = _tokens(text)
        self.i = 0
        self.max_clauses, self.max_values = max_clauses, max_values
        self.clauses = 0

    def peek(self, k: int = 0) -> tuple[str, str, int] | None:
        return self.toks[self.i + k] if self.i + k < len(self.toks) else None

    def keyword(self, word: str, k: int = 0) -> bool:
        t = self.peek(k)
        return t is not None and t[0] == "word" and t[1].lower() == word

    def shown(self, k: int = 0) -> str:
        t = self.peek(k)
        return "end of text" if t is None else f"{t[1]!r} at {t[2]}"

    def op(self, op: str, k: int = 0) -> bool:
        t = self.peek(k)
        return t is not None and t[0] == "op" and t[1] == op

    def parse(self) -> Expr:
        if not self.toks:
            return And(())  # no condition: every item passes
        expr = self.expr(0)
        if self.i < len(self.toks):
            raise ValueError(f"filter: expected 'and', 'or' or the end, got {self.shown()}")
        return expr

    def expr(self, depth: int) -> Expr:
        parts = [self.term(depth)]
        while self.keyword("or"):
            self.joint("or")
            parts.append(self.term(depth))
        return parts[0] if len(parts) == 1 else Or(tuple(parts))

    def term(self, depth: int) -> Expr:
        parts = [self.unary(depth)]
        while self.keyword("and"):
            self.joint("and")
            parts.append(self.unary(depth))
        return parts[0] if len(parts) == 1 else And(tuple(parts))

    def joint(self, word: str) -> None:
        """Steps over ``and`` / ``or``, which must not end the text."""
        self.i += 1
        if self.i == len(self.toks):
            raise ValueError(f"filter: dangling '{word}' at the end")

    def unary(self, depth: int) -> Expr:
        if depth >= MAX_DEPTH:
            raise FilterTooLargeError(
                f"filter: nested deeper than {MAX_DEPTH} at {self.shown()}", "max_depth"
            )
        if self.keyword("not"):
            self.i += 1
            child = self.unary(depth + 1)
            if isinstance(child, Clause):  # the old form: a negated clause
                return Clause(child.attribute, child.values, not child.negate)
            return child.child if isinstance(child, Not) else Not(child)
        if self.op("("):
            self.i += 1
            inner = self.expr(depth + 1)
            if not self.op(")"):
                raise ValueError(f"filter: expected ')', got {self.shown()}")
            self.i += 1
            return inner
        return self.pred()

    def pred(self) -> Expr:
        name = self.peek()
        if name is None or name[0] == "op" or (name[0] == "word" and name[1].lower() in _KEYWORDS):
            raise ValueError(f"filter: expected an attribute name, got {self.shown()}")
        attr = name[1]
        self.i += 1
        self.clauses += 1
        if self.max_clauses is not None and self.clauses > self.max_clauses:
            raise FilterTooLargeError(
                f"filter: more than {self.max_clauses} clauses", "max_clauses"
            )
        if not self.predicate_follows():
            return Clause(attr, ("true",))
        if self.op("=="):
            shown = self.peek(1)[1] if self.peek(1) is not None else "VALUE"  # type: ignore[index]
            raise ValueError(f"filter: write '{attr} = {shown}' (one '='), not '{attr} == {shown}'")
        if self.op("=") or self.op("!="):
            negate = self.op("!=")
            self.i += 1
            return Clause(attr, (self.value(attr),), negate)
        for op in ("<=", ">=", "<", ">"):
            if self.op(op):
                self.i += 1
                return Compare(attr, op, self.number(attr))
        negate = self.keyword("not")
        self.i += int(negate)
        if self.keyword("in"):
            self.i += 1
            return Clause(attr, self.value_set(attr), negate)
        if self.keyword("between"):
            self.i += 1
            low = self.number(attr)
            if not self.keyword("and"):
                raise ValueError(f"filter: expected 'and' in {attr} between, got {self.shown()}")
            self.i += 1
            both = And((Compare(attr, ">=", low), Compare(attr, "<=", self.number(attr))))
            return Not(both) if negate else both
        raise ValueError(f"filter: unexpected {self.shown()} after attribute {attr!r}")

    def predicate_follows(self) -> bool:
        """Whether an operator follows the name (else it is a boolean attribute)."""
        t = self.peek()
        if t is not None and t[0] == "op" and t[1] in ("=", "==", "!=", "<", "<=", ">", ">="):
            return True
        k = int(self.keyword("not"))
        return self.keyword("in", k) or self.keyword("between", k)

    def value(self, attr: str) -> str:
        t = self.peek()
        if t is None or t[0] == "op":
            raise ValueError(f"filter: expected a value for {attr}, got {self.shown()}")
        self.i += 1
        return t[1]

    def number(self, attr: str) -> float:
        t = self.peek()
        try:
            x = float(t[1]) if t is not None and t[0] == "word" else math.nan
        except ValueError:
            x = math.nan
        if math.isnan(x):
            raise ValueError(f"filter: expected a number for {attr}, got {self.shown()}")
        self.i += 1
        return x

    def value_set(self, attr: str) -> tuple[str, ...]:
        if not self.op("{"):
            raise ValueError(f"filter: expected '{{' after {attr} in, got {self.shown()}")
        self.i += 1
        vals: list[str] = []
        while True:
            t = self.peek()
            if t is None or t[0] == "op":
                raise ValueError(
                    f"filter: expected a value in the set of {attr}, got {self.shown()}"
                )
            vals.append(t[1])
            if self.max_values is not None and len(vals) > self.max_values:
                raise FilterTooLargeError(
                    f"filter: the set of {attr} holds more than {self.max_values} values",
                    "max_values",
                )
            self.i += 1
            if self.op("}"):
                self.i += 1
                return tuple(vals)
            if not self.op(","):
                raise ValueError(
                    f"filter: expected ',' or '}}' in the set of {attr}, got {self.shown()}"
                )
            self.i += 1


def parse_filter(
    text: str, *, max_clauses: int | None = None, max_values: int | None = None
) -> Expr:
    """Filter text -> its expression (see the module's grammar; blank text: ``And(())``, which
    every item passes). Raises ``ValueError`` naming
    the offending token and its offset, or :class:`FilterTooLargeError` at the first predicate
    past ``max_clauses``, value past ``max_values`` in one set, or level past :data:`MAX_DEPTH`
    (so the work done is bounded by the limits, not the text)."""
    return _Parser(text, max_clauses, max_values).parse()


def predicates(expr: Expr) -> list[Clause | Compare]:
    """The predicates of ``expr``, left to right."""
    if isinstance(expr, Clause | Compare):
        return [expr]
    if isinstance(expr, Not):
        return predicates(expr.child)
    return [p for c in expr.children for p in predicates(c)]


def format_filter(expr: Expr) -> str:
    """Inverse of :func:`parse_filter` (values always quoted, every group parenthesised)."""
    if isinstance(expr, Clause):
        vals = ", ".join('"' + v + '"' for v in expr.values)
        return f"{expr.attribute} {'not in' if expr.negate else 'in'} {{{vals}}}"
    if isinstance(expr, Compare):
        return f"{expr.attribute} {expr.op} {expr.bound!r}"
    if isinstance(expr, Not):
        return f"not ({format_filter(expr.child)})"
    joint = " and " if isinstance(expr, And) else " or "
    return "(" + joint.join(format_filter(c) for c in expr.children) + ")"
