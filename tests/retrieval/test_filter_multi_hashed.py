"""Multi-valued hashed attributes (tags: several of 10^5 values an item): the signatures are a
superset test, and every path verifies its candidates against the filter's exact clauses
(``retrieval/filter_verify.py``), so random filters (``in``, ``=``, ``!=``, ``not in``, with
other clauses) answer as brute force does, with no false positive: a search by text or by a
compiled batch, the model's ``execute``, the device backend (under the device discipline), a
router's shards (through the wire) and an index with fresh rows beside it; a live rewrite adds
a value to an item, and so do live messages (upsert, relabel; a fold keeps them); a save
keeps the lists."""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.device_discipline import DeviceDiscipline
from retrieval.data import SyntheticConfig, generate
from retrieval.filters import FilterSchema, filter_vocabulary
from retrieval.graphed_forward import GraphedForward
from retrieval.index import IVFConfig, IVFIndex, build_ivf
from retrieval.index.compaction import fold
from retrieval.index.device_search import all_vectors
from retrieval.index.live_index import relabel, signatures_of, upsert
from retrieval.index.search import Candidates, run_search
from retrieval.index.split import shard_of, split_index
from retrieval.index.update import set_values
from retrieval.live_updates import rewrite_attributes, signatures, value_positions
from retrieval.model import RetrievalModel
from retrieval.training.prepare import prepare
from serving.sharding.wire import decode_request, encode_request
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


def with_backend(idx: IVFIndex, backend: str) -> IVFIndex:
    """A copy of ``idx`` whose executor runs ``backend``."""
    out = copy.deepcopy(idx)
    out.executor.backend = backend
    return out


@functools.cache
def device_index() -> IVFIndex:
    return with_backend(index(), "device")


@functools.cache
def routed() -> tuple[IVFIndex, list[IVFIndex]]:
    return split_index(index(), shard_of(index().item_ids, 3), 3)


def routed_search(q: torch.Tensor, k: int, text: str) -> torch.Tensor:
    """What the router does: plan on the statistics, each shard answering the request the
    wire carries (its exact clauses included), candidates merged."""
    stats, shards = routed()
    fb = stats.compile_filter(text, q.shape[0])
    cfg = stats.config
    plan = stats.plan(fb, stats.params(k, cfg.nprobe, cfg.rerank), q=q)

    def fetch(p, rows):
        qq, f = (q, fb) if rows is None else (q[rows], fb.rows(rows))
        qq, f, p = decode_request(encode_request("m", 1, qq, f, p, False))
        return Candidates.concat([s.item_candidates(qq, f, p) for s in shards])

    return run_search(plan, fetch).keys


RELABELED = 1
"""An item whose color a live update changes: it moves to a fresh row, keeping its tags."""


@functools.cache
def live() -> IVFIndex:
    """The index with three fresh rows beside it: a new item N (holding no tag), item 0's
    replacement (its id's values gone with its old row) and item RELABELED turned blue."""
    idx = index()
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((2, 16)).astype(np.float32))
    sig = signatures(idx.schema, [{"color": ["red"]}, {"color": ["blue"]}])
    new = upsert(idx, torch.tensor([N, 0]), x, sig)
    blue = signatures_of(new, torch.tensor([RELABELED])).clone()
    blue &= ~idx.schema.compile(["color in {red, green, blue}"]).masks[0]
    blue |= idx.schema.compile(["color = blue"]).masks[0]
    return relabel(new, torch.tensor([RELABELED]), blue)


def live_truth(text: str, ok: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """What ``live()`` answers under ``text`` (``ok``: the built catalog's truth): ``(ok [N +
    2], vectors [N + 2, D])``, rows N and N + 1 the fresh items N and 0."""
    c = catalog()
    held = holds_of(c["attrs"]["tag"][RELABELED])
    fresh = np.array([_passes(text, "red", set()), _passes(text, "blue", set())])
    main = ok & (np.arange(N) != 0)
    main[RELABELED] = _passes(text, "blue", held)
    return np.concatenate([main, fresh]), torch.cat([c["x"], live().live.vectors[:2]])


def holds_of(positions: list[int]) -> set[str]:
    return {TAGS[p] for p in positions}


@settings(max_examples=40, deadline=None)
@given(expression())
def test_every_path_answers_as_brute_force(e):
    text, ok = e
    c = catalog()
    q, k, idx = c["q"], 10, index()
    fb = idx.compile_filter(text, q.shape[0])
    assert fb.verify is not None
    check_top_k(idx.search(q, k, fb)[0], ok, c["x"], k, text)
    check_top_k(idx.execute(q, fb, idx.params(k))[0], ok, c["x"], k, text)
    with DeviceDiscipline():
        ids, _ = device_index().execute(q, fb, idx.params(k))
    check_top_k(ids, ok, c["x"], k, text)
    check_top_k(routed_search(q, k, text), ok, c["x"], k, text)
    # fresh rows: item N and item 0 replaced (no tag), item RELABELED (its tags kept)
    want, x_all = live_truth(text, ok)
    got = live().search(q, k, text)[0]
    assert_best_eligible(torch.where(got == 0, N + 1, got), want, q, x_all, k, text)


def _passes(text: str, color: str, tags: set[str]) -> bool:
    """Whether an item of ``color`` holding ``tags`` passes ``text`` (brute force, by the
    expression tree)."""
    from retrieval.filter_expr import And, Clause, Not, Or, parse_filter

    def ev(e) -> bool:
        if isinstance(e, Clause):
            held = color in e.values if e.attribute == "color" else bool(tags & set(e.values))
            return held != e.negate
        if isinstance(e, Not):
            return not ev(e.child)
        if isinstance(e, And):
            return all(ev(ch) for ch in e.children)
        assert isinstance(e, Or)
        return any(ev(ch) for ch in e.children)

    return ev(parse_filter(text))


def test_a_compiled_batch_carries_its_exact_clauses_only_where_needed():
    """... and those rows scan exactly: a broad filter's superset would take lists, whose best
    by the superset could miss the items its exact clauses keep."""
    idx = index()
    fb = idx.compile_filter([f"tag != {TAGS[POPULAR[0]]}", None], 2)
    assert fb.verify is not None and fb.verify.rows.tolist() == [True, False]
    assert idx.compile_filter(["color = red", None], 2).verify is None
    assert idx.plan(fb, idx.params(5, 1)).exact.tolist() == [True, False]
    superset = idx.plan(dataclasses.replace(fb, verify=None), idx.params(5, 1))
    assert superset.exact.tolist() == [False, False]


def test_a_value_list_costs_bytes_per_value_held():
    lists = index().value_lists["tag"]
    nnz = sum(len(t) for t in catalog()["attrs"]["tag"])
    assert lists.nbytes() == 16 * N + 8 + 4 * nnz


def test_a_schema_without_lists_refuses_several_values():
    schema = FilterSchema(VALUES)
    with pytest.raises(ValueError, match="one value an item"):
        schema.value_bits("tag", ["t1", "t2"])


def test_live_messages_set_its_values():
    """An upsert naming tags (one no item had) and a relabel rewriting a main item's tags:
    searches see them at once (fresh rows verified by their ids' values), the relabeled item
    no longer matches its old tags, and a fold into the main index keeps all of it."""
    idx = copy.deepcopy(index())  # its schema learns a value
    q, new_id = catalog()["q"], N + 5
    x = torch.from_numpy(np.random.default_rng(11).standard_normal((1, 16)).astype(np.float32))
    attrs = [{"tag": ["fresh-tag", TAGS[POPULAR[0]]], "color": ["red"]}]
    up = upsert(
        idx, torch.tensor([new_id]), x, signatures(idx.schema, attrs),
        value_positions(idx.schema, attrs),
    )  # fmt: skip
    assert up.search(x, 1, "tag = fresh-tag")[0].tolist() == [[new_id]]
    assert new_id in up.search(x, 5, f"tag = {TAGS[POPULAR[0]]}")[0][0].tolist()
    old = TAGS[catalog()["attrs"]["tag"][2][0]]
    relabeled = [{"tag": ["fresh-tag"]}]
    sig = rewrite_attributes(up.schema, signatures_of(up, torch.tensor([2])), relabeled)
    both = relabel(up, torch.tensor([2]), sig, value_positions(up.schema, relabeled))
    for served in (both, fold(both)):
        got = served.search(q, N, "tag = fresh-tag")[0]
        assert set(got[0][got[0] >= 0].tolist()) == {new_id, 2}
        assert 2 not in served.search(q, N, f"tag = {old}")[0][0].tolist()
        assert 2 in served.search(q, N, f"tag != {old}")[0][0].tolist()


def test_an_upsert_through_the_model_sets_its_values():
    """The live message path (``apply_update``): an item upserted naming tags is found by
    them; one naming none holds none."""
    from retrieval.live_updates import apply_update
    from retrieval.update_batches import UpsertItems

    _, model, tags, vecs = tagged_model()
    model = copy.copy(model)
    model.index = copy.deepcopy(model.index)
    n = len(tags)
    batch = UpsertItems(
        torch.tensor([n, n + 1]),
        ({"tag": [TAGS[POPULAR[5]], "live-tag"]}, {}),
        vecs[:2].clone(),
    )
    updated = apply_update(model, batch)
    q = vecs[:1]
    assert updated.index.search(q, 5, "tag = live-tag")[0][0].tolist()[:2] == [n, -1]
    assert n in updated.index.search(q, 50, f"tag = {TAGS[POPULAR[5]]}")[0][0].tolist()
    assert n + 1 in updated.index.search(vecs[1:2], 5, "tag != live-tag")[0][0].tolist()


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
        assert [p in held for held in w.lists_of(w.ids)] == want


@functools.cache
def tagged_model() -> tuple[Any, RetrievalModel, np.ndarray, torch.Tensor]:
    """A trained-shape model whose index holds a multi-valued hashed ``tag`` beside the
    catalog's own attributes -> ``(prepared data, model, tags [N] lists, catalog vectors)``."""
    ds = generate(SyntheticConfig(num_users=32, num_items=1500, seed=3))
    prep = prepare(ds, history_len=8)
    prep.config.index.nlist = 16
    torch.manual_seed(0)
    model = RetrievalModel(prep.config).eval()
    vecs = model.catalog_vectors(prep.train.item_features).cpu()
    rng = np.random.default_rng(4)
    tags = [sorted(set(rng.choice(POPULAR, int(rng.integers(0, 4))).tolist())) for _ in vecs]
    vocab = filter_vocabulary(prep.config.item_attributes, prep.config.numeric_attributes)
    model.index = build_ivf(
        vecs,
        prep.config.index,
        item_attributes={**ds.item_attributes, "tag": tags},
        attribute_values={**vocab, "tag": TAGS},
    )
    return prep, model, np.array(tags, dtype=object), vecs


@pytest.mark.parametrize("backend", ["auto", "device"])
def test_the_models_forward_verifies_as_the_index_does(backend):
    """The served forward (a ``UserBatch`` carries the exact clauses to the index) on either
    backend: every request's best items among those its filter truly admits."""
    prep, model, tags, vecs = tagged_model()
    m = copy.copy(model)
    m.index = with_backend(model.index, backend)
    texts = [f"tag = {TAGS[POPULAR[0]]}", f"tag != {TAGS[POPULAR[1]]}", None]
    batch = prep.user_batch(np.arange(3), texts, schema=m.index.schema)
    ids, _ = m(batch, 10)
    t = m.index.tensors()
    q = t.scored(m.user_vectors(batch))
    scored = torch.zeros_like(vecs)  # by item id: the vectors the index scores (decoded codes)
    scored[t.item_ids] = all_vectors(t)
    truth = [
        np.array([POPULAR[0] in t for t in tags]),
        np.array([POPULAR[1] not in t for t in tags]),
        np.ones(len(tags), bool),
    ]
    for row, ok in enumerate(truth):
        ok = ok.copy()
        ok[batch.history[row][batch.history[row] >= 0].numpy()] = False  # the history: excluded
        assert_best_eligible(ids[row : row + 1], ok, q[row : row + 1], scored, 10, str(texts[row]))


def test_the_graphed_forward_answers_a_batch_with_exact_clauses_eagerly():
    """No whole-forward graph takes exact clauses (their atoms' shapes vary): such a batch
    runs the model's forward, on the device backend still, and answers as it does."""
    prep, model, _, _ = tagged_model()
    m = copy.copy(model)
    m.index = with_backend(model.index, "device")
    graphed = GraphedForward(m, max_batch=8)
    texts = [f"tag in {{{TAGS[POPULAR[2]]}, {TAGS[POPULAR[3]]}}}", None]
    batch = prep.user_batch(np.arange(2), texts, schema=m.index.schema)
    plain = prep.user_batch(np.arange(2), None, schema=m.index.schema)
    assert not graphed.accepts(batch) and graphed.accepts(plain)
    ids, scores = graphed(batch, 10)
    want_ids, want_scores = m(batch, 10)
    assert torch.equal(ids, want_ids) and torch.equal(scores, want_scores)
    assert graphed.records == 0


def test_a_routed_upsert_and_relabel_set_values_on_the_shard_holding_them():
    """What a router's shards apply (``live_shards.update_shard``): the shard owning the item
    keeps its values, so routed answers see the new tags as the unsharded index does."""
    from retrieval.live_shards import update_shard
    from retrieval.update_batches import SetItemAttributes, UpsertItems

    stats, shards = split_index(index(), shard_of(index().item_ids, 3), 3)
    shards = [copy.deepcopy(s) for s in shards]
    x = catalog()["x"][:1]
    upsert_batch = UpsertItems(torch.tensor([N + 7]), ({"tag": ["routed-tag"]},), x.clone())
    relabel_batch = SetItemAttributes(torch.tensor([3]), ({"tag": ["routed-tag"]},))
    for batch in (upsert_batch, relabel_batch):
        shards = [update_shard(s, batch, i, 3).index for i, s in enumerate(shards)]
        stats.schema.learn("tag", "routed-tag")  # the router learns it at commit
    fb = stats.compile_filter("tag = routed-tag", 1)
    plan = stats.plan(fb, stats.params(N), q=x)
    found = Candidates.concat([s.item_candidates(x, fb, plan) for s in shards]).keys
    assert set(found[0][found[0] >= 0].tolist()) == {N + 7, 3}
