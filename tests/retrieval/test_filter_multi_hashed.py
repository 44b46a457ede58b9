"""Multi-valued hashed attributes (tags: several of 10^5 values an item): the signatures are a
superset test, and ``IVFIndex.search`` verifies every answer against the index's value lists, so
random filters (``in``, ``=``, ``!=``, ``not in``, with other clauses) answer as brute force does,
with no false positive; a live rewrite adds a value to an item; a save keeps the lists; paths
that cannot verify refuse with an error naming the attribute."""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.filters import FilterSchema
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.update import set_values
from support.topk_check import assert_best_eligible

TAGS = [f"t{i}" for i in range(100_000)]
COLORS = ["red", "green", "blue"]
VALUES = {"tag": TAGS, "color": COLORS}
N = 800
POPULAR = [i * 7919 % 100_000 for i in range(24)]  # what filters name: a few items each


@functools.cache
def catalog() -> dict:
    rng = np.random.default_rng(5)
    tags = []
    for i in range(N):  # 0 to 6 values an item, most from a small popular set (digits collide)
        n = int(rng.integers(0 if i >= 10 else 1, 7))
        pick = np.where(rng.random(n) < 0.6, rng.choice(POPULAR, n), rng.integers(0, 100_000, n))
        tags.append(sorted(set(pick.tolist())))
    attrs = {"tag": tags, "color": rng.integers(0, 3, N)}
    x = torch.from_numpy(rng.standard_normal((N, 16)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((3, 16)).astype(np.float32))
    return {"attrs": attrs, "x": x, "q": q}


@functools.cache
def index() -> IVFIndex:
    c = catalog()
    cfg = IVFConfig(nlist=8, nprobe=2, rerank=200, exact_copy="float32")
    return build_ivf(c["x"], cfg, item_attributes=c["attrs"], attribute_values=VALUES)


def holds(names: list[str]) -> np.ndarray:
    keys = {TAGS.index(v) for v in names}
    return np.array([bool(keys & set(t)) for t in catalog()["attrs"]["tag"]])


NAMES = st.lists(st.sampled_from([TAGS[p] for p in POPULAR] + ["t99999"]), min_size=1, max_size=3)


@st.composite
def leaf(draw) -> tuple[str, np.ndarray]:
    names = draw(NAMES)
    listed = "{" + ", ".join(names) + "}"
    op = draw(st.sampled_from(["in", "=", "!=", "not in"]))
    if op == "=":
        return f"tag = {names[0]}", holds(names[:1])
    if op == "!=":
        return f"tag != {names[0]}", ~holds(names[:1])
    if op == "in":
        return f"tag in {listed}", holds(names)
    return f"not tag in {listed}", ~holds(names)


@st.composite
def expression(draw) -> tuple[str, np.ndarray]:
    text, ok = draw(leaf())
    how = draw(st.sampled_from(["alone", "and color", "or color", "and tag"]))
    color = draw(st.sampled_from(COLORS))
    is_color = catalog()["attrs"]["color"] == COLORS.index(color)
    if how == "and color":
        return f"{text} and color = {color}", ok & is_color
    if how == "or color":
        return f"({text}) or color = {color}", ok | is_color
    if how == "and tag":
        other, ok2 = draw(leaf())
        return f"({text}) and ({other})", ok & ok2
    return text, ok


def check_top_k(
    ids: torch.Tensor,
    ok: np.ndarray,
    x: torch.Tensor,
    k: int,
    text: str,
    q: torch.Tensor | None = None,
) -> None:
    """``ids [B, k]`` hold every row's best ``k`` eligible items (``ok [N]``) for queries ``q``
    (None: the catalog's), only them."""
    assert_best_eligible(ids, ok, catalog()["q"] if q is None else q, x, k, text)


def test_the_signatures_alone_admit_false_positives():
    """Why the lists are kept: the superset test admits items that hold no named value."""
    idx = index()
    fb = idx.schema.compile(["tag in {" + ", ".join(TAGS[p] for p in POPULAR[:3]) + "}"])
    from retrieval.filters import eligible

    passed = eligible(idx.sig, fb.masks[0], fb.negate[0]).numpy()
    truth = holds([TAGS[p] for p in POPULAR[:3]])[idx.item_ids.numpy()]
    assert (passed >= truth).all()  # no false negative
    assert (passed & ~truth).any()  # some false positives: the digits mix


@settings(max_examples=60, deadline=None)
@given(expression(), st.sampled_from([True, False]))
def test_search_answers_equal_brute_force_top_k(e, exact):
    text, ok = e
    c = catalog()
    ids, _ = index().search(c["q"], 10, text, exact=exact)
    check_top_k(ids, ok, c["x"], 10, text)


def test_a_batch_mixes_verified_and_plain_rows():
    c = catalog()
    texts = [f"tag = {TAGS[POPULAR[0]]}", "color = red", None]
    ids, _ = index().search(c["q"], 5, texts, nprobe=8)  # plain rows: every list
    colors = catalog()["attrs"]["color"]
    for row, ok in enumerate([holds([TAGS[POPULAR[0]]]), colors == 0, np.ones(N, bool)]):
        check_top_k(ids[row : row + 1], ok, c["x"], 5, str(texts[row]), c["q"][row : row + 1])


def test_a_live_rewrite_adds_a_value_to_an_item():
    """Item 3 takes a value no item had, and keeps its own: both filters find it."""
    idx = index()
    held = [TAGS[p] for p in catalog()["attrs"]["tag"][3]]
    new = set_values(idx, torch.tensor([3]), "tag", [[*held, "brand-new"]])
    q = catalog()["x"][3:4]
    for text in ("tag = brand-new", f"tag = {held[0]}"):
        ids, _ = new.search(q, 1, text)
        assert ids.tolist() == [[3]], text
    ids, _ = new.search(q, 5, "tag = brand-new")
    assert ids[0, 1:].eq(-1).all()  # only item 3 holds it
    ids, _ = idx.search(q, 1, "tag = brand-new")
    assert ids.tolist() == [[-1]]  # the old index unchanged (copy-on-write)


def test_a_saved_index_keeps_its_value_lists():
    idx = index()
    buf = io.BytesIO()
    torch.save(idx.state_dict(), buf)
    buf.seek(0)
    loaded = IVFIndex(idx.config, idx.dim, VALUES)
    loaded.load_state_dict(torch.load(buf, weights_only=False))
    text = f"tag in {{{TAGS[POPULAR[1]]}, {TAGS[POPULAR[2]]}}}"
    a, _ = idx.search(catalog()["q"], 10, text)
    b, _ = loaded.search(catalog()["q"], 10, text)
    assert torch.equal(a, b)


def test_paths_that_cannot_verify_refuse():
    idx = index()
    fb = idx.compile_filter(f"tag = {TAGS[POPULAR[0]]}", 3)
    with pytest.raises(ValueError, match="'tag'"):
        idx.search(catalog()["q"], 5, fb)
    with pytest.raises(ValueError, match="'tag'"):
        idx.execute(catalog()["q"], fb, idx.params(5, None, None))


def test_a_value_list_costs_bytes_per_value_held():
    lists = index().value_lists["tag"]
    nnz = sum(len(t) for t in catalog()["attrs"]["tag"])
    assert lists.nbytes() == 16 * N + 8 + 4 * nnz


def test_a_schema_without_lists_refuses_several_values():
    schema = FilterSchema(VALUES)
    with pytest.raises(ValueError, match="one value an item"):
        schema.value_bits("tag", ["t1", "t2"])


def test_live_updates_refuse_its_values():
    """The live messages keep no value lists: naming the attribute there is refused, not lost."""
    from retrieval.live_updates import UpdateError, signatures

    with pytest.raises(UpdateError, match="set_values"):
        signatures(index().schema, [{"tag": ["t1", "t2"]}])


def test_an_added_item_forgets_the_values_of_the_id_it_replaces():
    from retrieval.index.update import add_items

    idx = index()
    held = TAGS[catalog()["attrs"]["tag"][4][0]]
    x = catalog()["x"][4:5]
    new = add_items(
        idx, torch.tensor([4]), x, torch.zeros(1, idx.schema.num_words, dtype=torch.int64)
    )
    assert idx.search(x, 1, f"tag = {held}")[0].tolist() == [[4]]
    assert 4 not in new.search(x, N, f"tag = {held}")[0].tolist()[0]
    assert 4 in new.search(x, N, f"tag != {held}")[0].tolist()[0]  # it holds none now


def test_a_saved_shard_keeps_its_value_lists(tmp_path):
    from retrieval.artifact import load_shard, save_shard

    idx = index()
    save_shard(idx, tmp_path)
    loaded = load_shard(tmp_path)
    assert set(loaded.value_lists) == {"tag"}
    text = f"tag != {TAGS[POPULAR[3]]} and color = red"
    assert torch.equal(
        idx.search(catalog()["q"], 10, text)[0], loaded.search(catalog()["q"], 10, text)[0]
    )


LISTS = st.dictionaries(
    st.integers(0, 40), st.lists(st.integers(0, 99_999), max_size=4), max_size=12
)


@settings(max_examples=100, deadline=None)
@given(LISTS, LISTS)
def test_value_lists_replace_as_a_dict_does(old, new):
    from retrieval.value_lists import ValueLists

    v = ValueLists.of(np.array(list(old), np.int64), list(old.values()))
    w = v.replaced(np.array(list(new), np.int64), list(new.values()))
    got = {
        int(i): w.positions[w.offsets[j] : w.offsets[j + 1]].tolist() for j, i in enumerate(w.ids)
    }
    assert got == {**old, **new}
    assert (np.diff(w.ids) > 0).all()
    for p in range(0, 100_000, 9_973):
        want = [p in got[int(i)] for i in w.ids]
        assert w.holds(w.ids, [p]).tolist() == want
