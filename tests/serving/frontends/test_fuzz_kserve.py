"""Fuzzing KServe v2 on one real server (the tiny model on 127.0.0.1): gRPC ``ModelInfer`` and
HTTP ``/v2/models/demo/infer`` (uvicorn).

A valid call of 1-3 rows is mutated at random: inputs dropped, duplicated or unknown, wrong
datatypes and shapes, raw contents cut or grown (byte-size mismatch), values and K out of range,
random parameters, outputs, model and version; over HTTP also random JSON anywhere in the header,
a bad ``Inference-Header-Content-Length`` and cut bodies; over gRPC random and cut bytes. Every
answer is a success of the right shape or INVALID_ARGUMENT / NOT_FOUND (HTTP 400 / 404 / 413)
whose message starts with the input or part of the call it is about; a call that must be refused
is refused, a valid one is answered; nothing is INTERNAL, UNKNOWN or 5xx. A canary thread sends
valid calls during the whole run, and every one of them is answered.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from serving.app.server import Server
from serving.frontends import kserve_grpc
from serving.frontends.kserve_http import DEFAULT_MAX_BODY_BYTES, HEADER_LENGTH
from support.fuzz_util import WAIT, Canary, Quiet, fuzz_settings, serving
from support.kserve_calls import PREFIXES, Call, calls, judge, post, replace_somewhere
from support.tiny_model import Tiny

FUZZ = fuzz_settings(300)


@pytest.fixture(scope="module")
def tiny(tiny: Tiny) -> Tiny:
    """The session's tiny model (``tests/support/serving_fixtures.py``), quiet."""
    return Quiet(tiny)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("fuzz_kserve")
    with serving(tiny, root, [kserve_grpc.add_servicer], http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def channel(server: Server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.addresses.grpc) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.GRPCInferenceServiceStub:
    return pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def canary(server: Server, stub, tiny) -> Iterator[Canary]:
    """Sends a valid call every 20 ms during the whole module, gRPC and HTTP in turn."""
    valid = Call.valid(tiny, [5, 9])

    def call(n: int) -> None:
        if n % 2:
            assert list(stub.ModelInfer(valid.grpc(), timeout=WAIT).outputs[0].shape) == [2, 10]
        else:
            status, _, raw = post(server, *valid.http())
            assert status == 200, raw

    c = Canary(call)
    c.start()
    yield c
    c.stop()


# ---- gRPC -----------------------------------------------------------------------------------------
@pytest.mark.slow
@FUZZ
@given(st.data())
def test_grpc_model_infer_mutations(stub, canary, tiny, data):
    call = data.draw(calls(tiny), label="call")
    try:
        reply = stub.ModelInfer(call.grpc(), timeout=WAIT)
    except grpc.RpcError as e:
        judge(call, e.code().name, e.details() or "")
    else:
        judge(call, "OK", shape=list(reply.outputs[0].shape))


METHODS = {
    "ModelInfer": Call.valid,
    "ModelMetadata": lambda *_: pb.ModelMetadataRequest(name="demo"),
    "ModelConfig": lambda *_: pb.ModelConfigRequest(name="demo", version="1"),
    "ModelReady": lambda *_: pb.ModelReadyRequest(name="demo"),
}


@settings(max_examples=120, deadline=None, database=None)
@given(st.sampled_from(sorted(METHODS)), st.data())
def test_grpc_random_and_cut_bytes(channel, canary, tiny, method, data):
    """Bytes that do not parse get INVALID_ARGUMENT ``request: ...`` (not gRPC's INTERNAL);
    bytes that do are judged as the message they are."""
    good = METHODS[method](tiny, [1, 2], 10, ["available", ""])
    good = (good.grpc() if isinstance(good, Call) else good).SerializeToString()
    payload = data.draw(
        st.binary(max_size=300)
        | st.integers(0, len(good) - 1).map(lambda n: good[:n])
        | st.integers(0, len(good) - 1).map(lambda n: good[:n] + b"\xff" + good[n + 1 :])
    )
    request_type = getattr(pb, f"{method}Request")
    try:
        request_type.FromString(payload)
        parses = True
    except Exception:
        parses = False
    try:  # no serializers: bytes in, bytes out
        channel.unary_unary(f"/inference.GRPCInferenceService/{method}")(payload, timeout=WAIT)
        code, message = "OK", ""
    except grpc.RpcError as e:
        code, message = e.code().name, e.details() or ""
    event(f"{method} {'parses' if parses else 'does not parse'}: {code}")
    if not parses:
        assert code == "INVALID_ARGUMENT", (code, message)
        assert message.startswith(f"request: not a valid inference.{method}Request message")
        return
    assert code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND"), (code, message)
    assert code == "OK" or message.split(":", 1)[0] in PREFIXES, message


# ---- HTTP -----------------------------------------------------------------------------------------
def http_judge(
    server: Server, call: Call, body: bytes, headers: dict[str, str], loose: bool
) -> None:
    status, got, raw = post(server, call.path(), body, headers)
    assert status < 500, (status, raw[:300])
    if status != 200:
        judge(call, str(status), json.loads(raw)["error"], loose=loose)
        return
    n = int(got.get(HEADER_LENGTH, len(raw)))
    out = {o["name"]: o for o in json.loads(raw[:n])["outputs"]}
    judge(call, "200", shape=next(iter(out.values()))["shape"], loose=loose)


@pytest.mark.slow
@FUZZ
@given(st.data())
def test_http_infer_mutations(server, canary, tiny, data):
    """Mutations of the call, then of its JSON header and binary framing."""
    call = data.draw(calls(tiny), label="call")
    header, binary = call.json_header()
    loose = False
    if data.draw(st.integers(0, 3)) == 0 and replace_somewhere(data.draw, header):
        # it may even repair the call (outputs: [] drops a bad output name)
        call.maybe.append("random JSON")
        loose = True
    text = json.dumps(header).encode()
    body, length = text + binary, str(len(text))
    how = data.draw(st.sampled_from(["plain", "plain", "length", "cut", "no length", "gzip"]))
    if how == "length":
        length = data.draw(
            st.sampled_from(["1" * 5000, "²", "", "-1", "x", "1e3", "0x10", "0" + length])
            | st.integers(0, len(body) + 5).map(str)
        )
        if not (length.isdecimal() and len(length) < 20 and int(length) == len(text)):
            call.faults.append(f"{HEADER_LENGTH} {length[:20]!r}")
    elif how == "cut":
        body = body[: data.draw(st.integers(0, len(body) - 1))]
        call.faults.append("cut body")
    elif how == "no length" and binary:
        call.faults.append("binary data, no header length")
    event(f"how={how} length={length[:8]} version={call.version[:5]}")
    headers = {} if how == "no length" else {HEADER_LENGTH: length}
    if how == "gzip":
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    http_judge(server, call, body, headers, loose)


@settings(max_examples=60, deadline=None, database=None)
@given(st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_http_random_bodies(server, canary, payload):
    status, _, raw = post(server, "/v2/models/demo/infer", payload)
    assert status == 400, (status, raw)
    assert json.loads(raw)["error"].split(":", 1)[0] in PREFIXES


def test_http_deeply_nested_and_oversized_bodies(server, canary, tiny):
    call = Call.valid(tiny, [1])
    nested = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, _, raw = post(server, call.path(), nested)
    assert (status, json.loads(raw)["error"][:5]) == (400, "body:")
    call.to_typed()  # nested deep, but not too deep for the JSON parser, as data: names the input
    header, _ = call.json_header()
    header["inputs"][2]["data"] = json.loads("[" * 500 + "1.5" + "]" * 500)
    status, _, raw = post(server, call.path(), json.dumps(header).encode())
    assert status == 400 and json.loads(raw)["error"].startswith("dense: shape needs 3"), raw
    over = DEFAULT_MAX_BODY_BYTES + 1
    status, _, raw = post(server, call.path(), b" " * over)  # Content-Length says so: refused
    assert (status, json.loads(raw)["error"][:5]) == (413, "body:")
    chunks = iter([b" " * (1 << 20)] * 9)  # no Content-Length (chunked): refused while reading
    status, _, raw = post(server, call.path(), chunks)
    assert (status, json.loads(raw)["error"][:5]) == (413, "body:")
    bomb = gzip.compress(b" " * over)
    status, _, raw = post(server, call.path(), bomb, {"Content-Encoding": "gzip"})
    assert (status, json.loads(raw)["error"][:5]) == (413, "body:")


def found(tiny, change: str) -> Call:
    """A valid call with one change that was answered with INTERNAL / 500 before the fixes this
    fuzzing came with (kept as plain tests: the draws above need not repeat them)."""
    call = Call.valid(tiny, [1])
    call.to_typed()
    if change == "version":
        call.version = "1" * 5000  # int() refuses over 4300 digits: a ValueError
    elif change == "dense":
        call.tensors[2].values[0] = 10**400  # JSON can; numpy: OverflowError
    return call


@pytest.mark.parametrize(
    ("change", "field"),
    [("version", "version"), ("dense", "dense"), ("header length", HEADER_LENGTH)],
)
def test_calls_that_got_500_are_400_naming_the_field(server, stub, canary, tiny, change, field):
    call = found(tiny, change)
    path, body, headers = call.http()
    if change == "header length":
        headers[HEADER_LENGTH] = "1" * 5000
    status, _, raw = post(server, path, body, headers)
    assert status == 400 and json.loads(raw)["error"].startswith(field), raw
    if change == "version":
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(call.grpc(), timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("version: '1111")


# ---- after the run --------------------------------------------------------------------------------
def test_valid_calls_were_answered_during_and_after_the_run(server, stub, canary, tiny):
    """Runs last in this module (pytest keeps file order)."""
    assert canary.made(1) and not canary.failures, canary.failures[:5]
    call = Call.valid(tiny, [3, 4], k=12)
    with torch.inference_mode():
        ids, _ = tiny.model(tiny.prep.user_batch(np.array([3, 4])), 12)
    reply = stub.ModelInfer(call.grpc(), timeout=WAIT)
    got = np.frombuffer(reply.raw_output_contents[0], "<i8").reshape(2, 12)
    np.testing.assert_array_equal(got, ids.numpy())
    status, _, raw = post(server, *call.http())
    assert status == 200
    out = {o["name"]: o for o in json.loads(raw)["outputs"]}
    np.testing.assert_array_equal(np.reshape(out["item_ids"]["data"], (2, 12)), ids.numpy())
