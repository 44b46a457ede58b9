"""serving.frontends.kserve without a server: parsing both wire forms into RecRequests, rendering results,
and property tests that malformed inputs always end in a RequestError naming what is wrong."""

from __future__ import annotations

import dataclasses
import json
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from serving.frontends import kserve
from serving.frontends.kserve import ModelSpec, WireTensor
from serving.frontends.kserve_grpc import parameters, wire_tensors
from serving.frontends.kserve_http import json_outputs, json_tensors, split_body
from serving.types import INPUTS, OUTPUTS, RecResult, RequestError

SPEC = ModelSpec("demo", 1, categorical=3, dense=4, max_k=50, max_batch_size=8)
PREFIXES = (
    *INPUTS,
    "inputs",
    "raw_input_contents",
    "outputs",
    "parameters",
    "body",
    "Inference-Header-Content-Length",
)
"""What every RequestError message starts with."""


def good(batch: int = 2, raw: bool = True) -> list[WireTensor]:
    rng = np.random.default_rng(batch)
    a = {
        "history": np.array([[5, 9, -1]] * batch, np.int64),
        "categorical": rng.integers(0, 3, (batch, 3)).astype(np.int64),
        "dense": rng.standard_normal((batch, 4)).astype(np.float32),
        "k": np.full((batch, 1), 7, np.int32),
    }
    dts = {"history": "INT64", "categorical": "INT64", "dense": "FP32", "k": "INT32"}
    out = [
        WireTensor(
            n, dts[n], list(x.shape), x.tobytes() if raw else None, None if raw else x.tolist()
        )
        for n, x in a.items()
    ]
    filters = [b"language = en"] + [b""] * (batch - 1)
    blob = b"".join(struct.pack("<I", len(f)) + f for f in filters)
    out.append(
        WireTensor(
            "filter",
            "BYTES",
            [batch, 1],
            blob if raw else None,
            None if raw else [[f.decode()] for f in filters],
        )
    )
    return out


@pytest.mark.parametrize("raw", [True, False])
def test_parse_splits_rows(raw):
    reqs = kserve.parse(good(2, raw), SPEC, deadline=12.5)
    assert len(reqs) == 2
    r = reqs[0]
    assert r.history.tolist() == [5, 9, -1] and r.history.dtype == np.int64
    assert r.categorical.shape == (3,) and r.dense.dtype == np.float32 and r.k == 7
    assert (r.filter, reqs[1].filter) == ("language = en", None)
    assert (r.deadline, r.model) == (12.5, "demo")
    assert r.history.flags.writeable  # rows go to torch.from_numpy


def test_filter_is_optional_and_history_may_be_empty():
    tensors = [t for t in good(1) if t.name != "filter"]
    tensors[0] = WireTensor("history", "INT64", [1, 0], b"")
    (r,) = kserve.parse(tensors, SPEC)
    assert r.filter is None and r.history.shape == (0,)


def replace(tensors: list[WireTensor], name: str, **kw) -> list[WireTensor]:
    return [dataclasses.replace(t, **kw) if t.name == name else t for t in tensors]


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([t for t in good() if t.name != "dense"], "dense: missing input"),
        ([*good(), WireTensor("bogus", "INT64", [2], b"")], "inputs: unexpected input 'bogus'"),
        ([*good(), good()[0]], "history: given twice"),
        (replace(good(), "k", datatype="INT64"), "k: expected datatype INT32, got 'INT64'"),
        (replace(good(), "dense", shape=[2, 5]), "dense: expected shape [B, 4], got [2, 5]"),
        (replace(good(), "dense", shape=[8]), "dense: expected shape [B, 4], got [8]"),
        (replace(good(), "history", shape=[2, -3]), "history: expected shape [B, -1]"),
        (replace(good(), "dense", raw=b"\0" * 31), "dense: raw contents hold 31 bytes"),
        (replace(good(), "dense", shape=[1, 4], raw=b"\0" * 16), "dense: batch size 1 disagrees"),
        (
            replace(good(), "k", raw=np.int32([[7], [0]]).tobytes()),
            "k: must be in [1, 50], got 0 (batch row 1)",
        ),
        (
            replace(good(), "k", raw=np.int32([[51], [7]]).tobytes()),
            "k: must be in [1, 50], got 51 (batch row 0)",
        ),
        (replace(good(), "filter", raw=b"\x05\0\0\0ab"), "filter: BYTES element 0 claims 5 bytes"),
        (replace(good(), "filter", raw=b"\x01\0"), "filter: BYTES element 0: length prefix"),
        (
            replace(good(), "filter", raw=struct.pack("<I", 1) + b"\xff" + struct.pack("<I", 0)),
            "filter: not UTF-8",
        ),
        (
            replace(good(), "filter", raw=struct.pack("<I", 3) + b"a =" + struct.pack("<I", 0)),
            "filter:",
        ),
        (replace(good(), "dense", raw=None), "dense: has no contents"),
        (replace(good(), "dense", values=[1.0] * 8), "dense: has both raw and typed contents"),
        (
            replace(good(), "dense", raw=None, values=[1.0] * 7),
            "dense: shape needs 8 values, got 7",
        ),
        (
            replace(good(), "dense", raw=None, values=[[1.0] * 4, [1.0, 2.0, 3.0, "x"]]),
            "dense: 'x' is not an FP32 value",
        ),
        (replace(good(), "k", raw=None, values=[[True], [1]]), "k: True is not an INT32 value"),
        (replace(good(), "k", raw=None, values=[[2**31], [1]]), "k: 2147483648 is not an INT32"),
        (replace(good(), "filter", raw=None, values=[[1], [""]]), "filter: 1 is not a BYTES value"),
    ],
)
def test_bad_inputs_name_the_input(tensors, message):
    with pytest.raises(RequestError) as err:
        kserve.parse(tensors, SPEC)
    assert str(err.value).startswith(message), str(err.value)


def test_batch_size_is_bounded_by_max_batch_size():
    with pytest.raises(
        RequestError, match=r"^history: batch size must be in \[1, max_batch_size=8\], got 9"
    ):
        kserve.parse(good(9), SPEC)
    with pytest.raises(RequestError, match=r"^history: batch size must be in .* got 0"):
        kserve.parse(replace(good(1), "history", shape=[0, 3], raw=b""), SPEC)


def result(k: int) -> RecResult:
    return RecResult(
        np.arange(k, dtype=np.int64), np.linspace(1, 0, k, dtype=np.float32), "demo", 1
    )


def test_render_pads_rows_to_the_longest_k():
    ids, scores = kserve.render([result(3), result(1)], ["item_ids", "scores"])
    assert (ids.datatype, ids.shape, scores.datatype) == ("INT64", [2, 3], "FP32")
    assert ids.array.tolist() == [[0, 1, 2], [0, -1, -1]]
    assert scores.array[1, 1] == -np.inf
    assert np.frombuffer(ids.raw(), "<i8").tolist() == [0, 1, 2, 0, -1, -1]
    (only,) = kserve.render([result(2)], ["scores"])
    assert only.name == "scores"


def test_requested_outputs_and_deadline():
    assert kserve.requested_outputs([], SPEC) == list(OUTPUTS)
    with pytest.raises(RequestError, match=r"^outputs: unknown output 'x'"):
        kserve.requested_outputs(["x"], SPEC)
    with pytest.raises(RequestError, match=r"^outputs: unknown output 'raw_item_ids'"):
        kserve.requested_outputs(["raw_item_ids"], SPEC)  # a model without id maps
    with pytest.raises(RequestError, match=r"^outputs: .* twice"):
        kserve.requested_outputs(["scores", "scores"], SPEC)
    now = time.monotonic()
    assert kserve.deadline_from({}) is None
    assert kserve.deadline_from({}, remaining=9.2e18) is None  # grpc: the call has no deadline
    assert now + 1.9 < kserve.deadline_from({}, remaining=2.0) < now + 3  # type: ignore[operator]
    assert kserve.deadline_from({"timeout": 500_000}, remaining=2.0) < now + 1  # type: ignore[operator]
    with pytest.raises(RequestError, match=r"^parameters: timeout"):
        kserve.deadline_from({"timeout": "soon"})


def grpc_request(tensors: list[WireTensor]) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="demo")
    for t in tensors:
        req.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        req.raw_input_contents.append(t.raw or b"")
    return req


def test_grpc_requests_raw_and_typed():
    req = grpc_request(good())
    req.parameters["timeout"].int64_param = 5
    assert parameters(req.parameters) == {"timeout": 5}
    assert [r.k for r in kserve.parse(wire_tensors(req), SPEC)] == [7, 7]
    del req.raw_input_contents[-1]
    with pytest.raises(RequestError, match=r"^raw_input_contents: 4 entries for 5 inputs"):
        wire_tensors(req)
    typed = pb.ModelInferRequest()
    for t in good(raw=False):
        x = typed.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        flat = np.array(t.values, dtype=object).ravel().tolist()
        getattr(
            x.contents,
            {"INT64": "int64_contents", "INT32": "int_contents", "FP32": "fp32_contents"}.get(
                t.datatype, "bytes_contents"
            ),
        ).extend([v.encode() for v in flat] if t.datatype == "BYTES" else flat)
    reqs = kserve.parse(wire_tensors(typed), SPEC)
    assert reqs[0].filter == "language = en" and reqs[1].dense.dtype == np.float32
    typed.inputs[3].contents.int64_contents.append(1)
    with pytest.raises(
        RequestError,
        match=r"^k: INT32 contents go in int_contents, got int_contents, int64_contents",
    ):
        wire_tensors(typed)


def json_request(tensors: list[WireTensor], binary: bool) -> tuple[bytes, str | None]:
    inputs, blobs = [], []
    for t in tensors:
        entry = {"name": t.name, "datatype": t.datatype, "shape": t.shape}
        if binary:
            entry["parameters"] = {"binary_data_size": len(t.raw or b"")}
            blobs.append(t.raw or b"")
        else:
            entry["data"] = t.values
        inputs.append(entry)
    text = json.dumps(
        {"inputs": inputs, "outputs": [{"name": "scores", "parameters": {"binary_data": True}}]}
    ).encode()
    return text + b"".join(blobs), str(len(text)) if binary else None


@pytest.mark.parametrize("binary", [True, False])
def test_http_requests_json_and_binary(binary):
    body, length = json_request(good(raw=binary), binary)
    header, rest = split_body(body, length)
    assert [r.k for r in kserve.parse(json_tensors(header, rest), SPEC)] == [7, 7]
    assert json_outputs(header, {}, SPEC) == (["scores"], {"scores"})
    assert json_outputs({}, {"binary_data_output": True}, SPEC) == (list(OUTPUTS), set(OUTPUTS))
    if binary:
        with pytest.raises(RequestError, match=r"^inputs: 1 binary bytes after the last input"):
            json_tensors(header, rest + b"\0")
        with pytest.raises(
            RequestError, match=r"^filter: binary_data_size 21, but 20 binary bytes left"
        ):
            json_tensors(header, rest[:-1])


# ---- properties -----------------------------------------------------------------------------
names = st.sampled_from([*INPUTS, "bogus", ""])
datatypes = st.sampled_from(["INT64", "INT32", "FP32", "BYTES", "FP64", "BOOL", "", "int64"])
dims = st.lists(st.integers(-3, 9), max_size=4)
leaves = st.one_of(
    st.integers(-(2**65), 2**65),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
)
values = st.recursive(
    st.lists(leaves, max_size=10), lambda c: st.lists(c, max_size=4), max_leaves=40
)


@st.composite
def wire(draw) -> WireTensor:
    contents = draw(st.sampled_from(["raw", "values", "both", "none"]))
    raw = draw(st.binary(max_size=80)) if contents in ("raw", "both") else None
    vals = draw(values) if contents in ("values", "both") else None
    return WireTensor(draw(names), draw(datatypes), draw(dims), raw, vals)


def assert_named(e: RequestError) -> None:
    assert str(e).startswith(PREFIXES), str(e)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(wire(), max_size=6))
def test_random_tensors_never_crash(tensors):
    try:
        reqs = kserve.parse(tensors, SPEC)
    except RequestError as e:
        assert_named(e)
    else:
        assert 1 <= len(reqs) <= SPEC.max_batch_size


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutating_one_field_of_a_good_call_never_crashes(data):
    tensors = good(data.draw(st.integers(1, 3)), raw=data.draw(st.booleans()))
    i = data.draw(st.integers(0, len(tensors) - 1))
    t = tensors[i]
    field = data.draw(st.sampled_from(["name", "datatype", "shape", "raw", "values", "drop"]))
    if field == "drop":
        del tensors[i]
    elif field == "name":
        tensors[i] = dataclasses.replace(t, name=data.draw(names))
    elif field == "datatype":
        tensors[i] = dataclasses.replace(t, datatype=data.draw(datatypes))
    elif field == "shape":
        tensors[i] = dataclasses.replace(t, shape=data.draw(dims))
    elif field == "raw":
        tensors[i] = WireTensor(
            **{**t.__dict__, "raw": data.draw(st.binary(max_size=64)), "values": None}
        )
    else:
        tensors[i] = dataclasses.replace(t, raw=None, values=data.draw(values))
    try:
        kserve.parse(tensors, SPEC)
    except RequestError as e:
        assert_named(e)


json_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=4)
    ),
    lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(st.text(max_size=12), c, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_http_bodies_never_crash(data):
    body, length = json_request(good(raw=data.draw(st.booleans())), binary=data.draw(st.booleans()))
    header = json.loads(body[: int(length)] if length else body)
    where = data.draw(st.sampled_from(["top", "input", "param", "outputs"]))
    key = data.draw(
        st.sampled_from(
            [
                "inputs",
                "outputs",
                "parameters",
                "name",
                "datatype",
                "shape",
                "data",
                "binary_data_size",
                "binary_data_output",
            ]
        )
    )
    value = data.draw(json_values)
    if where == "top":
        header[key] = value
    elif where == "input":
        header["inputs"][data.draw(st.integers(0, 4))][key] = value
    elif where == "param":
        header["inputs"][data.draw(st.integers(0, 4))].setdefault("parameters", {})[key] = value
    else:
        header["outputs"] = [
            {"name": data.draw(st.sampled_from([*OUTPUTS, "x"])), "parameters": {key: value}}
        ]
    text = json.dumps(header).encode()
    tail = body[int(length) :] if length else b""
    cut = data.draw(st.integers(0, len(tail)))
    try:
        h, rest = split_body(text + tail[:cut], str(len(text)) if tail else None)
        params = h.get("parameters") or {}
        if isinstance(params, dict):
            json_outputs(h, params, SPEC)
            kserve.deadline_from(params)
        kserve.parse(json_tensors(h, rest), SPEC)
    except RequestError as e:
        assert_named(e)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.one_of(st.none(), st.text(max_size=4)))
def test_random_bytes_as_a_body_never_crash(body, length):
    try:
        h, rest = split_body(body, length)
        kserve.parse(json_tensors(h, rest), SPEC)
    except RequestError as e:
        assert_named(e)


def test_a_non_ascii_digit_header_length_is_a_request_error():
    """``"²".isdigit()`` is True but ``int("²")`` fails: found by the random-body property."""
    from serving.frontends.kserve_http import split_body
    from serving.types import RequestError

    with pytest.raises(RequestError, match="byte count"):
        split_body(b"{}", "²")
