"""Hashed attributes (a vocabulary of ``hashed_min_values`` or more, stored as its value's
position in hexadecimal digits): random expressions over them answer as a brute-force Python
evaluation does, through the compiled masks and ``IVFIndex.search``, sharded or not; a live
update brings a value no item had; an index keeps its layout through a save and a split."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from retrieval.filters import (
    NUMERIC,
    FilterSchema,
    FilterTooLargeError,
    eligible,
    hashed_digits,
)
from retrieval.index import IVFConfig, IVFIndex, build_ivf, live_index
from retrieval.index.plan import SearchPlan
from retrieval.index.search import Candidates, run_search
from retrieval.index.split import shard_of, split_index
from retrieval.live_updates import signatures
from support.topk_check import assert_best_eligible

CREATORS = [f"c{i}" for i in range(5000)]
COLORS = ["red", "green", "blue"]
VALUES = {"creator": CREATORS, "color": COLORS, "price": NUMERIC}
N = 600


@functools.cache
def catalog() -> dict:
    rng = np.random.default_rng(3)
    # a few creators hold many items (what filters name), the rest one or two
    popular = rng.integers(0, 12, N)
    creator = np.where(rng.random(N) < 0.7, popular * 401 % 5000, rng.integers(0, 5000, N))
    attrs = {
        "creator": creator,
        "color": rng.integers(0, len(COLORS), N),
        "price": np.round(rng.normal(10, 5, N), 1),
    }
    x = torch.from_numpy(rng.standard_normal((N, 16)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((3, 16)).astype(np.float32))
    schema = FilterSchema(VALUES)
    return {"attrs": attrs, "x": x, "q": q, "schema": schema, "sig": schema.signatures(attrs, N)}


NAMED = [f"c{i * 401 % 5000}" for i in range(12)] + ["c4999", "c7", "nobody"]


def creator_is(names: list[str]):
    keys = [CREATORS.index(v) for v in names if v in CREATORS]
    return lambda a: np.isin(a["creator"], keys)


@st.composite
def leaf(draw):
    """``(text, fn(attrs) -> bool [N])``: a creator set (negated or not: exact, so anywhere),
    a color, or a price bound."""
    kind = draw(st.sampled_from(["creator", "creator", "color", "price"]))
    if kind == "creator":
        names = draw(st.lists(st.sampled_from(NAMED), min_size=1, max_size=4, unique=True))
        fn = creator_is(names)
        if draw(st.booleans()):
            return f"creator not in {{{', '.join(names)}}}", lambda a, f=fn: ~f(a)
        if len(names) == 1:
            return f"creator = {names[0]}", fn
        return f"creator in {{{', '.join(names)}}}", fn
    if kind == "color":
        c = draw(st.sampled_from(COLORS))
        return f"color = {c}", lambda a, c=COLORS.index(c): a["color"] == c
    bound = draw(st.sampled_from([5.0, 10.0, 12.5]))
    return f"price < {bound}", lambda a, b=bound: a["price"].astype(np.float32) < np.float32(b)


@st.composite
def expression(draw, depth: int = 2):
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return draw(leaf())
    op = draw(st.sampled_from(["and", "or", "not"]))
    if op == "not":
        text, fn = draw(expression(depth - 1))
        return f"not ({text})", lambda a, f=fn: ~f(a)
    parts = draw(st.lists(expression(depth - 1), min_size=2, max_size=3))
    text = f" {op} ".join(f"({t})" for t, _ in parts)
    join = np.logical_and if op == "and" else np.logical_or
    return text, lambda a, ps=parts: functools.reduce(join, [f(a) for _, f in ps])


def compiles(text: str) -> None:
    """Rejects an example with two color negations inside one 'or' (refused; one compiles,
    and a hashed attribute's negation does anywhere) or that passes the clause limit (each 'or' of a
    creator multiplies by its digits' clauses)."""
    try:
        catalog()["schema"].check(text)
    except FilterTooLargeError:
        reject()
    except ValueError as e:
        assert "'color != " in str(e) or "'color not in " in str(e), (text, e)
        reject()


def test_a_large_vocabulary_is_hashed_in_few_bits():
    schema = catalog()["schema"]
    assert schema.hashed_digits == {"creator": hashed_digits(5000)} == {"creator": 4}
    assert schema.num_bits == 4 * 16 + 3 + 128  # against 5,000 bits at one a value
    assert FilterSchema(VALUES, hashed_min_values=None).num_bits == 5000 + 3 + 128


@settings(max_examples=150, deadline=None)
@given(expression())
def test_compiled_expressions_admit_what_python_admits(e):
    text, fn = e
    compiles(text)
    c = catalog()
    fb = c["schema"].compile([text])
    nm = None if fb.neg_masks is None else fb.neg_masks[0]
    got = eligible(c["sig"], fb.masks[0], fb.negate[0], nm).numpy()
    np.testing.assert_array_equal(got, fn(c["attrs"]), err_msg=text)


@functools.cache
def index() -> IVFIndex:
    c = catalog()
    cfg = IVFConfig(nlist=8, nprobe=2, rerank=200, exact_copy="float32")
    return build_ivf(c["x"], cfg, item_attributes=c["attrs"], attribute_values=VALUES)


@settings(max_examples=60, deadline=None)
@given(expression())
def test_eligible_positions_drive_past_the_unlisted_digits(e):
    """The C++ pass and its torch twin (the GPU's) admit what Python admits: a clause on a
    digit the postings leave out never drives."""
    from retrieval.index.eligible_scan import eligible_positions, eligible_positions_torch

    text, fn = e
    compiles(text)
    idx = index()
    t, fb = idx.tensors(), idx.compile_filter(text, 1)
    want = np.flatnonzero(fn(catalog()["attrs"]))
    for way in (eligible_positions, eligible_positions_torch):
        nm = None if fb.neg_masks is None else fb.neg_masks[0]
        got = np.sort(idx.item_ids[way(t, fb.masks[0], fb.negate[0], nm)].numpy())
        np.testing.assert_array_equal(got, want, err_msg=f"{way.__name__}: {text}")


def check_top_k(ids: torch.Tensor, ok: np.ndarray, x: torch.Tensor, k: int, text: str) -> None:
    """``ids [B, k]`` hold every row's best ``k`` eligible items (``ok [N]``), only them."""
    assert_best_eligible(ids, ok, catalog()["q"], x, k, text)


@settings(max_examples=60, deadline=None)
@given(expression(), st.sampled_from([True, False]))
def test_search_answers_equal_brute_force_top_k(e, exact):
    text, fn = e
    compiles(text)
    c = catalog()
    ids, _ = index().search(c["q"], 10, text, nprobe=8, exact=exact)  # every list
    check_top_k(ids, fn(c["attrs"]), c["x"], 10, text)


def sharded_search(stats: IVFIndex, shards: list[IVFIndex], q, k: int, text: str, exact: bool):
    """What the router does, in one process: plan on the statistics, merge shard candidates."""
    fb = stats.compile_filter(text, q.shape[0])
    plan = stats.plan(fb, stats.params(k, exact=exact, target=None), q=q)

    def fetch(p: SearchPlan, rows):
        qq, f = (q, fb) if rows is None else (q[rows], fb.rows(rows))
        return Candidates.concat([s.item_candidates(qq, f, p) for s in shards])

    return run_search(plan, fetch).keys


@functools.cache
def split() -> tuple[IVFIndex, list[IVFIndex]]:
    idx = index()
    return split_index(idx, shard_of(idx.item_ids, 2), 2)


@settings(max_examples=30, deadline=None)
@given(expression(), st.sampled_from([True, False]))
def test_sharded_answers_equal_unsharded(e, exact):
    text, fn = e
    compiles(text)
    c = catalog()
    stats, shards = split()
    ids = sharded_search(stats, shards, c["q"], 10, text, exact)
    if exact:
        check_top_k(ids, fn(c["attrs"]), c["x"], 10, text)
    else:  # the plan's lists: what one index answers with the same plan
        want, _ = index().search(c["q"], 10, text)
        assert ids.tolist() == want.tolist(), text


def test_a_live_update_brings_a_creator_no_item_had():
    idx = copy.deepcopy(index())  # its schema learns the new creator
    schema = idx.schema
    before = len(schema.vocabulary("creator"))
    q = catalog()["q"][:1]
    assert idx.search(q, 5, "creator = newcomer", exact=True)[0][0].tolist() == [-1] * 5
    sig = signatures(schema, [{"creator": ["newcomer"], "color": ["red"]}])
    new = live_index.upsert(idx, torch.tensor([N + 5]), torch.ones(1, 16), sig)
    assert schema.position["creator"]["newcomer"] == before  # the next position
    for exact in (True, False):
        ids, _ = new.search(q, 5, "creator = newcomer and color = red", exact=exact)
        assert ids[0].tolist() == [N + 5, -1, -1, -1, -1]
        ids, _ = new.search(q, N, "creator != newcomer", exact=exact)
        assert N + 5 not in ids[0].tolist() and int((ids[0] >= 0).sum()) == N
    # a relabel moves an item from one creator to another (here: a second new one)
    moved = live_index.relabel(
        new, torch.tensor([N + 5]), signatures(schema, [{"creator": ["c7"]}])
    )
    assert N + 5 in moved.search(q, 50, "creator = c7", exact=True)[0][0].tolist()
    assert moved.search(q, 5, "creator = newcomer", exact=True)[0][0].tolist() == [-1] * 5


def test_a_hashed_attribute_holds_one_value_an_item():
    schema = catalog()["schema"]
    with pytest.raises(ValueError, match="one value an item"):
        schema.value_bits("creator", ["c1", "c2"])
    with pytest.raises(ValueError, match="one value an item"):
        schema.signatures({"creator": np.zeros((2, 5000), bool)}, 2)
    small = FilterSchema({"creator": ["a", "b"]}, hashed_min_values=2)
    small.learn("creator", "c")  # 16 positions with one digit: 13 more fit
    for v in range(13):
        small.learn("creator", f"v{v}")
    with pytest.raises(ValueError, match="holds 16 values"):
        small.learn("creator", "one too many")


def test_the_layout_survives_a_save_and_a_grown_vocabulary():
    idx = copy.deepcopy(index())
    schema = idx.schema
    for i in range(30_000):  # the vocabulary doubles: a fresh schema would take another digit
        schema.learn("creator", f"grown{i}")
    assert hashed_digits(len(schema.vocabulary("creator"))) == 5
    loaded = IVFIndex(idx.config, idx.dim, {"creator": ["x"], "color": COLORS, "price": NUMERIC})
    loaded.load_state_dict(idx.state_dict())
    assert loaded.schema.hashed_digits == {"creator": 4}
    c = catalog()
    ids, _ = loaded.search(c["q"], 10, "creator in {c0, c401}", exact=True)
    check_top_k(ids, creator_is(["c0", "c401"])(c["attrs"]), c["x"], 10, "reload")


def test_a_million_values_cost_few_bytes_an_item():
    """Memory per item of a 10^6-value attribute over the same index without it: signature
    words, and its values' postings (4 bytes an item and the buckets' offsets; the inverted
    index over bits lists none of its digits)."""
    n = 4000
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((n, 8)).astype(np.float32))
    cfg = IVFConfig(nlist=4, nprobe=4, measure_costs=False)
    color = {"color": rng.integers(0, 3, n)}
    base = build_ivf(x, cfg, item_attributes=color, attribute_values={"color": COLORS})
    vocab = {"color": COLORS, "creator": [str(v) for v in range(10**6)]}
    with_creator = build_ivf(
        x,
        cfg,
        item_attributes={**color, "creator": rng.integers(0, 10**6, n)},
        attribute_values=vocab,
    )
    per_item = {
        name: (with_creator.memory_bytes()[name] - base.memory_bytes()[name]) / n
        for name in ("sig", "postings", "value_postings", "value_offsets")
    }
    assert with_creator.schema.hashed_digits == {"creator": 6}
    assert per_item["postings"] == 0  # no digit is listed by bit
    assert per_item["value_postings"] == 4  # an item under its value's bucket
    assert per_item["value_offsets"] <= 2  # at least 4 items a bucket
    assert sum(per_item.values()) <= 16  # 96 bits: two words at most
    counts = with_creator.bit_counts[with_creator.schema.attribute_bits("creator")]
    assert int(counts.sum()) == 6 * n  # still counted, for the planner


def test_new_creators_take_one_position_on_every_shard():
    """Two new creators in one batch, their items on different shards: each shard learns
    both, in the batch's order, as the router does at commit (else a shard's first new creator
    would take the position the router gave the second). An update a shard prepared and then
    dropped forgets its new value, so the next one takes the same position everywhere."""
    from retrieval.live_shards import stats_index, update_shard
    from retrieval.update_batches import UpsertItems

    stats, shards = copy.deepcopy(split())
    spare = torch.arange(N + 1, N + 40)
    owner = shard_of(spare, 2)
    ids = torch.stack([spare[owner == 1][0], spare[owner == 0][0]])  # shard 1, then shard 0

    def upsert(names: list[str]) -> UpsertItems:
        attrs = [{"creator": [v]} for v in names]
        n = len(names)
        return UpsertItems(ids[:n], attrs, torch.ones(n, 16), torch.ones(n, dtype=torch.bool))

    def router_commit(router: IVFIndex, batch: UpsertItems, parts: list[IVFIndex]) -> IVFIndex:
        counts = sum(p.bit_counts for p in parts)
        sizes = sum(live_index.list_sizes(p) for p in parts)
        return stats_index(router, sizes, counts, batch)

    dropped = update_shard(shards[0], upsert(["never-applied"]), 0, 2)  # prepared, then
    dropped.index.schema.forget(dropped.learned_from)  # aborted
    batch = upsert(["first-new", "second-new"])

    signatures(stats.schema, batch.attributes, learn=False)  # the router's resolve checks
    assert "first-new" not in stats.schema.position["creator"]
    updated = [update_shard(s, batch, i, 2).index for i, s in enumerate(shards)]
    router = router_commit(stats, batch, updated)
    for name, item in zip(("first-new", "second-new"), ids.tolist(), strict=True):
        positions = {s.schema.position["creator"][name] for s in (router, *updated)}
        assert positions == {5000 if name == "first-new" else 5001}, name
        fb = router.compile_filter(f"creator = {name}", 1)
        found = [s.search(torch.ones(1, 16), 3, fb, exact=True)[0][0].tolist() for s in updated]
        assert sorted(i for f in found for i in f if i >= 0) == [item], name


def test_a_clause_on_unlisted_digits_never_drives():
    """Every item's position a multiple of 16: the key's top digit is 0 for all, and no bit
    postings list a digit. Were those digits counted 0, a clause on them would drive with no
    candidates and admit nothing; the values' buckets drive instead."""
    from retrieval.index.eligible_scan import eligible_positions, eligible_positions_torch

    rng = np.random.default_rng(1)
    creator = rng.integers(0, 5000 // 16, 400) * 16
    idx = build_ivf(
        torch.randn(400, 8),
        IVFConfig(nlist=2, nprobe=2, measure_costs=False),
        item_attributes={"creator": creator},
        attribute_values={"creator": CREATORS},
    )
    t = idx.tensors()
    value = int(creator[0])
    fb = idx.compile_filter(f"creator = c{value}", 1)
    want = np.flatnonzero(creator == value)
    for way in (eligible_positions, eligible_positions_torch):
        nm = None if fb.neg_masks is None else fb.neg_masks[0]
        got = np.sort(idx.item_ids[way(t, fb.masks[0], fb.negate[0], nm)].numpy())
        np.testing.assert_array_equal(got, want, err_msg=way.__name__)


@pytest.mark.slow
def test_a_model_filters_by_a_hashed_creator_and_takes_a_new_one():
    """The forward (what serving and batch scoring run) with a hashed creator among the item
    tower's attributes: only and all the items a filter admits; an upsert without a vector
    names a creator the tower never saw (its item goes without that feature)."""
    from retrieval.data import SyntheticConfig, generate
    from retrieval.features import item_feature_ids
    from retrieval.live_updates import apply_update
    from retrieval.model import RetrievalModel
    from retrieval.training.prepare import prepare
    from retrieval.update_batches import UpsertItems

    c = catalog()
    prep = prepare(generate(SyntheticConfig(num_users=8, num_items=N, seed=2)), history_len=4)
    cfg = copy.deepcopy(prep.config)
    cfg.item_attributes = {"creator": CREATORS, "color": COLORS}  # type: ignore[assignment]
    cfg.numeric_attributes = ("price",)
    prep.config = cfg
    torch.manual_seed(0)
    model = RetrievalModel(cfg)
    tower_in = {a: v for a, v in c["attrs"].items() if a != "price"}
    model.build_index(item_feature_ids(tower_in, N), c["attrs"])
    model.eval()
    assert model.index.schema.hashed_digits == {"creator": 4}
    text = "creator in {c0, c401, c802} or (color = red and creator != c0)"
    users = np.arange(4)
    batch = prep.user_batch(users, [text] * len(users))
    with torch.inference_mode():
        ids, _ = model(batch, 30)
    ok = creator_is(["c0", "c401", "c802"])(c["attrs"]) | (
        (c["attrs"]["color"] == 0) & ~creator_is(["c0"])(c["attrs"])
    )
    for row in range(len(users)):
        allowed = ok.copy()
        allowed[batch.history[row][batch.history[row] >= 0].numpy()] = False
        got = ids[row][ids[row] >= 0].numpy()
        assert allowed[got].all() and len(got) == min(30, int(allowed.sum()))
    new = N - 1  # replaced, by a creator nobody had, its vector from the tower
    upsert = UpsertItems(torch.tensor([new]), [{"creator": ["newcomer"], "color": ["red"]}])
    model = apply_update(model, upsert)
    ids, _ = model.index.search(torch.ones(1, cfg.out_dim), 5, "creator = newcomer", exact=True)
    assert ids[0].tolist() == [new, -1, -1, -1, -1]


def test_a_creator_learned_during_a_compaction_is_found_after_it():
    """The fold reads a snapshot; a new creator learned by an update meanwhile stays known to
    the rebased index (it adopts the latest schema, not the snapshot's)."""
    from retrieval.index.compaction import fold, rebase

    idx = copy.deepcopy(index())
    q = catalog()["q"][:1]
    first = live_index.upsert(
        idx, torch.tensor([N + 1]), torch.ones(1, 16), signatures(idx.schema, [{"creator": ["c7"]}])
    )
    folded = fold(first)  # the snapshot, before the newcomer
    sig = signatures(first.schema, [{"creator": ["latecomer"], "color": ["blue"]}])
    now = live_index.upsert(first, torch.tensor([N + 2]), torch.ones(1, 16), sig)
    assert first.live is not None
    served = rebase(folded, first.live, now)
    assert served is not None
    for exact in (True, False):
        ids, _ = served.search(q, 5, "creator = latecomer and color = blue", exact=exact)
        assert ids[0].tolist() == [N + 2, -1, -1, -1, -1]
