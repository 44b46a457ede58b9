"""Filter parsing (property tests), compilation to bit masks, and evaluation."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.filters import (
    Clause,
    FilterSchema,
    FilterTooLargeError,
    bit_counts,
    eligible,
    estimate_selectivity,
    format_filter,
    parse_filter,
)

names = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda s: s not in ("and", "not", "in")
)
values = st.from_regex(r"[A-Za-z0-9 _+\-]{1,10}", fullmatch=True)
clauses = st.builds(
    Clause, names, st.lists(values, min_size=1, max_size=4).map(tuple), st.booleans()
)


@settings(max_examples=200, deadline=None)
@given(st.lists(clauses, min_size=1, max_size=5))
def test_format_then_parse_is_identity(cs):
    assert parse_filter(format_filter(cs)) == cs


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_parser_never_crashes_on_garbage(text):
    with contextlib.suppress(ValueError):
        parse_filter(text)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("available", [Clause("available", ("true",))]),
        ("not available", [Clause("available", ("true",), True)]),
        ("language in {en, fr}", [Clause("language", ("en", "fr"))]),
        ("language not in {en}", [Clause("language", ("en",), True)]),
        ("region != 'south america'", [Clause("region", ("south america",), True)]),
        (
            "a = 1 and not b = 2 and c",
            [Clause("a", ("1",)), Clause("b", ("2",), True), Clause("c", ("true",))],
        ),
    ],
)
def test_parse_examples(text, expected):
    assert parse_filter(text) == expected


@pytest.mark.parametrize(
    "text", ["a in {1,", "a =", "a b", "a and", "= 3", "a in 1", "a in {1 2}", "a = {"]
)
def test_malformed_filters_raise(text):
    with pytest.raises(ValueError, match="filter"):
        parse_filter(text)


@pytest.fixture
def schema_and_items():
    schema = FilterSchema(
        {
            "language": ["en", "fr", "de"],
            "genre": ["drama", "comedy", "horror"],
            "available": ["false", "true"],
        }
    )
    rng = np.random.default_rng(0)
    n = 500
    attrs = {
        "language": rng.integers(0, 3, n),
        "genre": rng.random((n, 3)) < 0.4,
        "available": rng.integers(0, 2, n),
    }
    return schema, attrs, schema.signatures(attrs, n)


def test_signatures_evaluate_like_python(schema_and_items):
    schema, attrs, sig = schema_and_items
    fb = schema.compile(["language in {en, fr} and available and not genre = horror"])
    got = eligible(sig, fb.masks[0], fb.negate[0]).numpy()
    want = (attrs["language"] <= 1) & (attrs["available"] == 1) & ~attrs["genre"][:, 2]
    assert np.array_equal(got, want)


def test_batch_with_mixed_clause_counts_pads_with_true(schema_and_items):
    schema, _, sig = schema_and_items
    fb = schema.compile([None, "language = de", "available and genre in {drama, comedy}"])
    assert fb.masks.shape == (3, 2, 1)
    got = eligible(sig.unsqueeze(0).expand(3, -1, -1), fb.masks, fb.negate)
    assert got[0].all()
    assert torch.equal(
        got[1],
        eligible(
            sig,
            *schema.compile(["language = de"]).masks[0:1],
            schema.compile(["language = de"]).negate[0],
        ),
    )


def test_unknown_attribute_or_value_is_named(schema_and_items):
    schema, _, _ = schema_and_items
    with pytest.raises(ValueError, match="colour"):
        schema.compile(["colour = red"])
    with pytest.raises(ValueError, match=r"'es'.*language"):
        schema.compile(["language = es"])


def test_selectivity_estimate_is_exact_for_single_valued(schema_and_items):
    schema, attrs, sig = schema_and_items
    fb = schema.compile(["language in {en, fr}"])
    est = estimate_selectivity(fb, bit_counts(sig), sig.shape[0])
    assert est.item() == pytest.approx((attrs["language"] <= 1).mean())


def test_more_than_64_values_span_several_words():
    schema = FilterSchema({"city": [f"c{i}" for i in range(150)]})
    codes = np.arange(300) % 150
    sig = schema.signatures({"city": codes}, 300)
    assert sig.shape == (300, 3)
    fb = schema.compile(["city in {c0, c70, c149}"])
    got = eligible(sig, fb.masks[0], fb.negate[0]).numpy()
    assert np.array_equal(got, np.isin(codes, [0, 70, 149]))


def test_parse_stops_at_the_first_clause_or_value_past_its_limit():
    assert len(parse_filter("a and b", max_clauses=2, max_values=1)) == 2
    with pytest.raises(FilterTooLargeError, match="more than 2 clauses") as e:
        parse_filter("a and b and c and " + "d and " * 1000 + "e", max_clauses=2)
    assert e.value.limit == "max_clauses"
    with pytest.raises(FilterTooLargeError, match="the set of x holds more than 2") as e:
        parse_filter("x in {1, 2, 3}", max_values=2)
    assert e.value.limit == "max_values"
    assert isinstance(e.value, ValueError)  # callers that catch ValueError still do
