"""Fuzzing the admin update API on one real server (a private copy of the tiny model, live
updates on): random ids (known, new, negative, huge, repeated), vectors (none, the model's width,
another width, NaN, infinity, huge), attributes (known, unknown, unknown values, repeated),
tables, rows and values, model and version, and random bytes.

Every refusal is INVALID_ARGUMENT or NOT_FOUND naming the wire field, and leaves the served model
and its update log exactly as they were (all-or-nothing); an update that is sure to be bad is
refused; an accepted one is logged with the next sequence number; the server still recommends
after every call.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import grpc
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from retrieval.index import live_index
from serving.app.server import Server
from serving.limits import LimitsConfig
from serving.live import admin, messages
from serving.live.update_log import log_path, read_log
from serving.protos import admin_pb2 as pb
from serving.protos.admin_pb2_grpc import AdminStub
from serving.protos.recommend_pb2_grpc import RecommenderStub
from support.fuzz_util import WAIT, Quiet, fuzz_settings, serving
from support.tiny_model import Tiny

NUM_ITEMS = 300
ID_BOUND = NUM_ITEMS + LimitsConfig().max_item_id_growth
"""An upserted id must be below the catalog + ``limits.max_item_id_growth`` (the default)."""
DIM = 64
TABLES = {"item": (300, 32), "user_region": (6, 32), "attr_language": (8, 32), "nope": (1, 32)}
ATTRIBUTES = {"language": ["en", "fr", "xx"], "available": ["true", "false", "maybe"], "colour": ["red"]}  # fmt: skip
FIELDS = ("items", "ids", "table", "rows", "values", "model", "version", "request", "attributes")
"""What a refusal's message starts with (``items[2].vector: ...`` starts with ``items``)."""
FUZZ = fuzz_settings(200)


@pytest.fixture(scope="module")
def tiny(tiny: Tiny) -> Tiny:
    """The session's tiny model (``tests/support/serving_fixtures.py``), quiet."""
    return Quiet(tiny)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("fuzz_admin")
    extra = [admin.add_servicer]
    with serving(tiny, root, extra, private_model=True, state_dir=root / "state") as s:
        yield s


@pytest.fixture(scope="module")
def channel(server: Server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.addresses.grpc) as ch:
        yield ch


def fingerprint(server: Server) -> str:
    """A digest of every tensor of the served model (index and tables)."""
    digest = hashlib.sha1()
    for name, t in server.host.current().model.state_dict().items():
        if isinstance(t, torch.Tensor):
            digest.update(name.encode())
            digest.update(
                t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
            )
    live = server.host.current().model.index.live  # the fresh segment: no state_dict entry
    if live is not None:
        for t in (live.ids, live.vectors, live.sig, live.alive, live.tombstones):
            digest.update(t.cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def logged(server: Server) -> int:
    return len(read_log(log_path(server.config.state_dir, "demo", 1)).records)


# ---- requests ------------------------------------------------------------------------------------
ids = st.one_of(
    st.integers(0, NUM_ITEMS - 1),  # in the index (unless removed by an earlier example)
    st.integers(5000, 5010),  # new
    st.sampled_from([-1, -(2**63), 2**63 - 1, NUM_ITEMS, ID_BOUND - 1, ID_BOUND]),
)
floats = st.one_of(
    st.floats(-1, 1, width=32),
    st.floats(-1, 1, width=32),
    st.sampled_from([3e38, -3e38, 1e-45, math.nan, math.inf, -math.inf]),
)


@st.composite
def attributes(draw: st.DrawFn, bad: list[str]) -> list[pb.Attribute]:
    out = []
    names = st.sampled_from(["language", "available", "language", "available", "colour"])
    for name in draw(st.lists(names, max_size=3)):
        values = draw(st.lists(st.sampled_from(ATTRIBUTES[name]), max_size=2))
        out.append(pb.Attribute(name=name, values=values))
        if name == "colour" or any(v in ("xx", "maybe") for v in values):
            bad.append(f"attribute {name}={values}")
    names = [a.name for a in out]
    if len(set(names)) != len(names):
        bad.append("an attribute given twice")
    return out


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, object, list[str]]:
    """-> (method, message, why it must be refused whatever the index holds)."""
    bad: list[str] = []
    method = draw(
        st.sampled_from(["UpsertItems", "SetItemAttributes", "UpdateEmbeddings", "RemoveItems"])
    )
    target = {}
    if draw(st.integers(0, 5)) == 0:
        target["model"] = draw(st.sampled_from(["demo", "other", ""]))
        bad += [f"model {target['model']!r}"] if target["model"] not in ("demo", "") else []
    if draw(st.integers(0, 5)) == 0:
        target["version"] = draw(st.sampled_from([0, 1, 2, -1, 2**63 - 1]))
        bad += [f"version {target['version']}"] if target["version"] not in (0, 1) else []
    if method == "UpdateEmbeddings":
        table = draw(st.sampled_from(list(TABLES)))
        rows_n, width = TABLES[table]
        row = st.integers(0, rows_n - 1) | st.sampled_from([-1, rows_n, 2**63 - 1])
        rows = draw(st.lists(row, min_size=1, max_size=3) | st.just([]))
        n_values = len(rows) * width + draw(st.sampled_from([0, 0, 0, -1, 1, width]))
        values = draw(st.lists(floats, min_size=max(n_values, 0), max_size=max(n_values, 0)))
        bad += ["unknown table"] if table == "nope" else []
        bad += ["no rows"] if not rows else []
        bad += ["rows out of range"] if any(not 0 <= r < rows_n for r in rows) else []
        bad += ["rows repeated"] if len(set(rows)) != len(rows) else []
        bad += ["values count"] if n_values != len(rows) * width else []
        bad += ["values not finite"] if not all(map(math.isfinite, values)) else []
        return (
            method,
            pb.UpdateEmbeddingsRequest(table=table, rows=rows, values=values, **target),
            bad,
        )
    item_ids = draw(st.lists(ids, min_size=1, max_size=3) | st.just([]))
    bad += ["no ids"] if not item_ids else []
    bad += ["negative id"] if any(i < 0 for i in item_ids) else []
    bad += ["an id twice"] if len(set(item_ids)) != len(item_ids) else []
    if method == "RemoveItems":  # (the test adds: an id not in the index now)
        return method, pb.RemoveItemsRequest(ids=item_ids, **target), bad
    if method == "SetItemAttributes":
        items = [pb.ItemAttributes(id=i, attributes=draw(attributes(bad))) for i in item_ids]
        return method, pb.SetItemAttributesRequest(items=items, **target), bad
    bad += ["an id past the catalog + growth"] if any(i >= ID_BOUND for i in item_ids) else []
    items = []
    for i in item_ids:
        width = draw(st.sampled_from([DIM, 0, DIM, 3, DIM + 1]))
        vector = draw(st.lists(floats, min_size=width, max_size=width))
        if width not in (0, DIM):
            bad.append(f"vector of {width}")
        elif width and not all(map(math.isfinite, vector)):
            bad.append("vector not finite")
        elif width and math.hypot(*vector) > messages.MAX_VECTOR_NORM:
            bad.append("vector too long")
        elif not width and i >= NUM_ITEMS:
            bad.append("no vector beyond the item table")
        items.append(pb.Item(id=i, vector=vector, attributes=draw(attributes(bad))))
    return method, pb.UpsertItemsRequest(items=items, **target), bad


# ---- the tests -----------------------------------------------------------------------------------
@FUZZ
@given(requests())
def test_admin_requests_are_applied_whole_or_refused_whole(server, channel, tiny, call):
    method, msg, bad = call
    before, log_before = fingerprint(server), logged(server)
    if method in ("RemoveItems", "SetItemAttributes"):
        in_index = set(live_index.served_ids(server.host.current().model.index).tolist())
        wanted = msg.ids if method == "RemoveItems" else [it.id for it in msg.items]
        bad = bad + [f"{i} is not in the index" for i in wanted if i >= 0 and i not in in_index]
    try:
        reply = getattr(AdminStub(channel), method)(msg, timeout=WAIT)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        field = details.split(":", 1)[0].split("[", 1)[0].split(".", 1)[0].split(" ", 1)[0]
        event(f"{code.name} {field}")
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), details
        assert field in FIELDS, f"names no field: {details!r}"
        assert fingerprint(server) == before, f"a refused update changed the model: {details}"
        assert logged(server) == log_before
        assert bad, f"refused a valid update: {details!r}"
    else:
        event(f"applied {method}")
        assert not bad, f"applied an update that must be refused: {bad}"
        assert reply.sequence == log_before + 1 == logged(server)
    answer = RecommenderStub(channel).Recommend(tiny.message(0), timeout=WAIT)
    assert len(answer.item_ids) == 10


@settings(max_examples=60, deadline=None, database=None)
@given(
    st.sampled_from(["UpsertItems", "SetItemAttributes", "UpdateEmbeddings", "RemoveItems"]),
    st.binary(max_size=120),
)
def test_admin_random_bytes(server, channel, method, payload):
    before, log_before = fingerprint(server), logged(server)
    request_type = getattr(pb, f"{method}Request")
    try:
        request_type.FromString(payload)
        parses = True
    except Exception:
        parses = False
    try:
        channel.unary_unary(f"/recserve.admin.v1.Admin/{method}")(payload, timeout=WAIT)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
    event(f"{'parses' if parses else 'does not parse'}: {code.name}")
    if not parses:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert details.startswith(f"request: not a valid recserve.admin.v1.{method}Request")
    elif code != grpc.StatusCode.OK:
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), details
    if code != grpc.StatusCode.OK:
        assert fingerprint(server) == before and logged(server) == log_before


VALID_ATTRIBUTES = st.dictionaries(
    st.sampled_from(["language", "available", "category"]),
    st.lists(st.sampled_from(["en", "fr"]), max_size=2),
    max_size=2,
).map(
    lambda d: [
        pb.Attribute(name=k, values=v if k == "language" else ["true"] if k == "available" else [])
        for k, v in d.items()
    ]
)
finite = st.floats(-1, 1, width=32) | st.sampled_from([1e16, -1e16, 65504.0, 1e-45, 0.0])
"""Components of vectors no longer than ``messages.MAX_VECTOR_NORM`` (64 of them)."""


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_valid_updates_are_applied(server, channel, tiny, data):
    """Valid updates of every kind (finite values however large, ids up to the bound) are
    applied, logged, and the server still recommends with finite scores."""
    in_index = live_index.served_ids(server.host.current().model.index).tolist()
    log_before = logged(server)

    def known(most: int) -> list[int]:  # draws positions, not ids: the index changes
        picks = data.draw(st.lists(st.integers(0, 2**20), min_size=1, max_size=most))
        return sorted({in_index[p % len(in_index)] for p in picks})

    method = data.draw(
        st.sampled_from(["UpsertItems", "SetItemAttributes", "UpdateEmbeddings", "RemoveItems"])
    )
    if method == "UpsertItems":
        new = st.integers(0, NUM_ITEMS - 1) | st.integers(5000, 5010) | st.just(ID_BOUND - 1)
        items = []
        for i in data.draw(st.lists(new, min_size=1, max_size=3, unique=True)):
            width = DIM if i >= NUM_ITEMS else data.draw(st.sampled_from([DIM, 0]))
            vector = data.draw(st.lists(finite, min_size=width, max_size=width))
            items.append(pb.Item(id=i, vector=vector, attributes=data.draw(VALID_ATTRIBUTES)))
        msg: object = pb.UpsertItemsRequest(items=items)
    elif method == "RemoveItems":
        msg = pb.RemoveItemsRequest(ids=known(2))
    elif method == "SetItemAttributes":
        items_a = [
            pb.ItemAttributes(id=i, attributes=data.draw(VALID_ATTRIBUTES)) for i in known(3)
        ]
        msg = pb.SetItemAttributesRequest(items=items_a)
    else:
        table = data.draw(st.sampled_from([t for t in TABLES if t != "nope"]))
        rows_n, width = TABLES[table]
        rows = data.draw(st.lists(st.integers(0, rows_n - 1), min_size=1, max_size=3, unique=True))
        values = data.draw(st.lists(finite, min_size=len(rows) * width, max_size=len(rows) * width))
        msg = pb.UpdateEmbeddingsRequest(table=table, rows=rows, values=values)
    reply = getattr(AdminStub(channel), method)(msg, timeout=WAIT)
    event(f"applied {method}")
    assert reply.sequence == log_before + 1 == logged(server)
    answer = RecommenderStub(channel).Recommend(tiny.message(0), timeout=WAIT)
    assert len(answer.item_ids) == 10
    assert all(math.isfinite(s) or s == -math.inf for s in answer.scores), list(answer.scores)


def test_a_vector_too_long_for_float32_distances_is_refused(server, channel):
    """Found by the test above: a finite vector of length ~2e19 has a squared distance to every
    list of infinity, faiss assigns it list -1, and the update failed with INTERNAL."""
    before, log_before = fingerprint(server), logged(server)
    item = pb.Item(id=5000, vector=[0.0] * (DIM - 1) + [2e19])
    with pytest.raises(grpc.RpcError) as err:
        AdminStub(channel).UpsertItems(pb.UpsertItemsRequest(items=[item]), timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("items[0].vector: its length 2e+19 is over 1e+18")
    assert fingerprint(server) == before and logged(server) == log_before
