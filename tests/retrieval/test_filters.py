"""Filter parsing (property tests), compilation to bit masks, and evaluation."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import retrieval.filters as filters_module
from retrieval.filter_expr import And
from retrieval.filters import (
    Clause,
    FilterSchema,
    FilterTooLargeError,
    eligible,
    format_filter,
    parse_filter,
)
from retrieval.index.build import bit_index

names = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda s: s not in ("and", "not", "in", "or", "between")
)
values = st.from_regex(r"[A-Za-z0-9 _+\-]{1,10}", fullmatch=True)
clauses = st.builds(
    Clause, names, st.lists(values, min_size=1, max_size=4).map(tuple), st.booleans()
)


@settings(max_examples=200, deadline=None)
@given(st.lists(clauses, min_size=1, max_size=5))
def test_format_then_parse_is_identity(cs):
    assert parse_filter(format_filter(_all(cs))) == _all(cs)


def _all(cs):
    """Clauses as the parser gives them: one alone, several ANDed."""
    return cs[0] if len(cs) == 1 else And(tuple(cs))


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
    assert parse_filter(text) == _all(expected)


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


def test_a_filter_is_parsed_once_then_kept_compiled_within_a_bound(schema_and_items, monkeypatch):
    schema, _, _ = schema_and_items
    first = schema.compile(["language = de", "available and not genre = horror"])
    parsed = []
    real = filters_module.parse_filter
    monkeypatch.setattr(
        filters_module, "parse_filter", lambda text, **kw: parsed.append(text) or real(text, **kw)
    )
    again = schema.compile(["available and not genre = horror", None, "language = de"])
    assert parsed == []  # both texts were kept
    assert torch.equal(again.masks[0], first.masks[1]) and torch.equal(
        again.masks[2, :1], first.masks[0, :1]
    )
    assert torch.equal(again.negate[0], first.negate[1])
    again.masks.zero_()  # the rows are copies: the kept masks stay
    assert torch.equal(schema.compile(["language = de"]).masks, first.masks[:1, :1])
    with pytest.raises(ValueError, match="klingon"):  # a bad text is not kept: refused each time
        schema.compile(["language = klingon"])
    with pytest.raises(ValueError, match="klingon"):
        schema.compile(["language = klingon"])
    parsed.clear()
    monkeypatch.setattr(filters_module, "COMPILED_FILTERS", 3)
    for text in ["language = en", "language = fr", "genre = drama", "genre = comedy"]:
        schema.compile([text])
        assert len(schema._compiled) <= 3
    assert parsed == ["language = en", "language = fr", "genre = drama", "genre = comedy"]


def test_more_than_64_values_span_several_words():
    schema = FilterSchema({"city": [f"c{i}" for i in range(150)]})
    codes = np.arange(300) % 150
    sig = schema.signatures({"city": codes}, 300)
    assert sig.shape == (300, 3)
    fb = schema.compile(["city in {c0, c70, c149}"])
    got = eligible(sig, fb.masks[0], fb.negate[0]).numpy()
    assert np.array_equal(got, np.isin(codes, [0, 70, 149]))


def test_parse_stops_at_the_first_clause_or_value_past_its_limit():
    assert len(parse_filter("a and b", max_clauses=2, max_values=1).children) == 2
    with pytest.raises(FilterTooLargeError, match="more than 2 clauses") as e:
        parse_filter("a and b and c and " + "d and " * 1000 + "e", max_clauses=2)
    assert e.value.limit == "max_clauses"
    with pytest.raises(FilterTooLargeError, match="the set of x holds more than 2") as e:
        parse_filter("x in {1, 2, 3}", max_values=2)
    assert e.value.limit == "max_values"
    assert isinstance(e.value, ValueError)  # callers that catch ValueError still do


def test_integer_and_boolean_values_are_named_by_their_text():
    schema = FilterSchema({"label": list(range(10)), "flag": [False, True], "kind": ["a", "b"]})
    assert schema.attribute_values["label"][3] == "3" and schema.attribute_values["flag"] == [
        "false",
        "true",
    ]
    n = 200
    codes = np.arange(n) % 10
    sig = schema.signatures({"label": codes, "flag": codes % 2}, n)
    for text, want in [
        ("label = 3", codes == 3),
        ("label in {1, 2}", np.isin(codes, [1, 2])),
        ("flag", codes % 2 == 1),
        ("not flag and label != 4", (codes % 2 == 0) & (codes != 4)),
    ]:
        fb = schema.compile([text])
        assert np.array_equal(eligible(sig, fb.masks[0], fb.negate[0]).numpy(), want), text
    assert FilterSchema(schema.to_dict()).bit_of == schema.bit_of  # saved as text, reloads


@pytest.mark.parametrize(
    "values,match",
    [
        ({"label": [1, "1"]}, r"duplicate values \('1' twice"),
        ({"price": [1.5, 2.0]}, r"attribute_values\['price'\]: 1.5 is a float; give strings"),
    ],
)
def test_values_that_cannot_be_named_are_refused(values, match):
    with pytest.raises(ValueError, match=match):
        FilterSchema(values)


@pytest.mark.parametrize(
    "text,match",
    [
        ("label == 3", r"write 'label = 3' \(one '='\), not 'label == 3'"),
        ("label ==", r"write 'label = VALUE'"),
        ("a = 1 && b", r"conditions join with 'and'"),
        ("a = 1 || b", r"alternatives join with 'or'"),
        ("a in [1, 2]", r"write a set in braces"),
    ],
)
def test_common_mistakes_say_what_to_write(text, match):
    with pytest.raises(ValueError, match=match):
        parse_filter(text)


def test_a_batch_parses_each_distinct_filter_once(schema_and_items, monkeypatch):
    import retrieval.filters as filters_module

    schema, _, _ = schema_and_items
    calls: list[str] = []
    real = filters_module.parse_filter
    monkeypatch.setattr(filters_module, "parse_filter", lambda t: calls.append(t) or real(t))
    batch = ["language = en"] * 500 + [None, "available"] * 3
    fb = schema.compile(batch)
    assert sorted(calls) == ["available", "language = en"]
    assert fb.masks.shape[0] == len(batch)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [None, "language = en", "available and genre in {drama, comedy}", "not language = de"]
        ),
        max_size=12,
    )
)
def test_compiling_a_batch_equals_compiling_each_row(rows):
    schema = FilterSchema(
        {"language": ["en", "fr", "de"], "genre": ["drama", "comedy"], "available": ["true"]}
    )
    fb = schema.compile(rows)
    assert fb.masks.shape[0] == len(rows)
    for b, text in enumerate(rows):
        one = schema.compile([text])
        c = one.masks.shape[1]
        assert torch.equal(fb.masks[b, :c], one.masks[0]) and torch.equal(
            fb.negate[b, :c], one.negate[0]
        )
        assert bool(fb.negate[b, c:].all()) and not bool(fb.masks[b, c:].any())  # padding: true


@settings(max_examples=40, deadline=None)
@given(
    vocabs=st.lists(st.integers(1, 150), min_size=1, max_size=4),
    multi=st.lists(st.booleans(), min_size=4, max_size=4),
    n=st.integers(0, 70),
    seed=st.integers(0, 99),
)
def test_signatures_counts_and_postings_equal_a_bit_by_bit_build(vocabs, multi, n, seed):
    """Attributes of any vocabulary size (blocks straddling 64-bit words), single- or
    multi-valued: every item's bits are exactly its values', counts and postings agree."""

    rng = np.random.default_rng(seed)
    schema = FilterSchema(
        {f"a{j}": [str(v) for v in range(vocab)] for j, vocab in enumerate(vocabs)}
    )
    attrs: dict[str, np.ndarray] = {}
    want = np.zeros((n, schema.num_words * 64), dtype=bool)
    for j, vocab in enumerate(vocabs):
        first = schema.bit_of[(f"a{j}", "0")]
        if multi[j]:
            attrs[f"a{j}"] = rng.random((n, vocab)) < 0.3
            want[:, first : first + vocab] = attrs[f"a{j}"]
        else:
            attrs[f"a{j}"] = rng.integers(0, vocab, n)
            want[np.arange(n), first + attrs[f"a{j}"]] = True
    sig = schema.signatures(attrs, n)
    got = (sig.numpy().view(np.uint64)[:, :, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)
    assert np.array_equal(got.reshape(n, schema.num_words * 64).astype(bool), want)
    counts, postings = bit_index(sig)  # the index's C++ counting sort
    assert np.array_equal(counts.numpy(), want.sum(axis=0))
    assert np.array_equal(postings.numpy(), np.argwhere(want.T)[:, 1])
