"""A KServe v2 inference call that the fuzz tests (``test_fuzz_kserve.py``) build, mutate and
send over gRPC or HTTP, knowing which mutations must make the server refuse it, and
:func:`judge`, which checks the server's answer against that. ``from kserve_calls import ...``.
"""

from __future__ import annotations

import copy
import http.client
import json
import struct
from dataclasses import dataclass, field
from urllib.parse import quote

import numpy as np
from hypothesis import event, reject
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from serving.app.server import Server
from serving.frontends.kserve_http import HEADER_LENGTH
from serving.types import DATATYPES, INPUTS, OPTIONAL_INPUTS, OUTPUTS

PREFIXES = (
    *INPUTS,
    "inputs",
    "raw_input_contents",
    "outputs",
    "parameters",
    "model",
    "version",
    "request",
    "body",
    HEADER_LENGTH,
)
"""What the message of every refusal starts with (the input or the part of the call)."""
CONTENTS = {"INT64": "int64_contents", "INT32": "int_contents", "FP32": "fp32_contents"}
WIRE_DTYPE = {"INT64": "<i8", "INT32": "<i4", "FP32": "<f4"}


# ---- one call, in either wire format --------------------------------------------------------------
@dataclass
class Tensor:
    name: str
    datatype: str
    shape: list[int]
    raw: bytes | None
    values: list | None = None
    """Typed contents (flat) when ``raw`` is None."""
    contents: str = ""
    """The gRPC typed-contents field they go in (chosen for the original datatype)."""
    valid: tuple[str, list[int], int] = ("", [], 0)
    """(datatype, shape, bytes of raw contents) it had when it was valid."""

    def __post_init__(self) -> None:
        if not self.valid[0]:
            self.valid = (self.datatype, list(self.shape), len(self.raw or b""))

    def faults(self) -> list[str]:
        """What is wrong with it whatever the call holds (empty: maybe nothing)."""
        datatype, shape, size = self.valid
        out = [f"{self.name} datatype {self.datatype!r}"] if self.datatype != datatype else []
        out += [f"{self.name} shape {self.shape}"] if self.shape != shape else []
        if self.raw is not None and len(self.raw) != size:
            out.append(f"{self.name} raw contents of {len(self.raw)} bytes, not {size}")
        return out


@dataclass
class Call:
    """One inference call, and why it must (or may) be refused."""

    tensors: list[Tensor]
    rows: int
    k: int
    model: str = "demo"
    version: str = ""
    parameters: dict[str, object] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    """Mutations of the call (not of one tensor) that make it invalid."""
    maybe: list[str] = field(default_factory=list)
    """Mutations that may or may not (a random value or parameter)."""

    @property
    def must_fail(self) -> list[str]:
        """Why the call must be refused (empty: it must be answered, unless ``maybe``)."""
        out = [*self.faults, *(f for t in self.tensors for f in t.faults())]
        names = [t.name for t in self.tensors]
        for name in INPUTS:
            if names.count(name) > 1 or (name not in OPTIONAL_INPUTS and name not in names):
                out.append(f"{name} given {names.count(name)} times")
        out += [f"unknown input {n!r}" for n in names if n not in INPUTS]
        out += [f"output {n!r}" for n in self.outputs if n not in OUTPUTS]
        if len(set(self.outputs)) != len(self.outputs):
            out.append("an output asked for twice")
        if self.model != "demo":
            out.append(f"model {self.model!r}")
        v = self.version
        if v and not (v.isascii() and v.isdigit() and len(v) <= 18 and int(v) == 1):
            out.append(f"version {v[:20]!r}")
        if not 1 <= self.k <= 300:
            out.append(f"k {self.k}")
        return out

    @classmethod
    def valid(cls, tiny, users: list[int], k: int = 10, filters: list[str] | None = None) -> Call:
        arrays = tiny.inputs(np.array(users), k)
        tensors = [
            Tensor(n, DATATYPES[n], list(x.shape), x.astype(WIRE_DTYPE[DATATYPES[n]]).tobytes())
            for n, x in arrays.items()
        ]
        if filters is not None:
            blob = b"".join(struct.pack("<I", len(f)) + f.encode() for f in filters)
            tensors.append(Tensor("filter", "BYTES", [len(users), 1], blob))
        return cls(tensors, len(users), k)

    def to_typed(self) -> None:
        for t in self.tensors:
            t.values, t.raw = typed_values(t), None
            t.contents = CONTENTS.get(t.datatype, "bytes_contents")

    def grpc(self) -> pb.ModelInferRequest:
        req = pb.ModelInferRequest(model_name=self.model, model_version=self.version, id="f")
        raw = all(t.raw is not None for t in self.tensors)
        try:
            for t in self.tensors:
                wire = req.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
                if raw:
                    req.raw_input_contents.append(t.raw)
                elif t.values is not None:
                    if any(isinstance(v, bool) for v in t.values):
                        reject()  # protobuf takes True for 1 (deprecated); JSON cannot
                    getattr(wire.contents, t.contents).extend(t.values)
            for key, value in self.parameters.items():
                kind = {bool: "bool_param", int: "int64_param", float: "double_param"}
                setattr(req.parameters[key], kind.get(type(value), "string_param"), value)
        except (TypeError, ValueError, OverflowError):  # a value protobuf cannot carry (HTTP can)
            reject()
        for name in self.outputs:
            req.outputs.add(name=name)
        return req

    def json_header(self) -> tuple[dict, bytes]:
        """-> (the JSON header, the binary data after it)."""
        inputs, blobs = [], []
        for t in self.tensors:
            spec: dict[str, object] = {"name": t.name, "datatype": t.datatype, "shape": t.shape}
            if t.raw is not None:
                spec["parameters"] = {"binary_data_size": len(t.raw)}
                blobs.append(t.raw)
            else:
                spec["data"] = [v.decode() if isinstance(v, bytes) else v for v in t.values or []]
            inputs.append(spec)
        header: dict[str, object] = {"inputs": inputs, "parameters": self.parameters}
        if self.outputs:
            header["outputs"] = [{"name": n} for n in self.outputs]
        return header, b"".join(blobs)

    def path(self) -> str:
        version = f"/versions/{quote(self.version)}" if self.version else ""
        return f"/v2/models/{quote(self.model)}{version}/infer"

    def http(self) -> tuple[str, bytes, dict[str, str]]:
        header, binary = self.json_header()
        text = json.dumps(header).encode()
        return self.path(), text + binary, {HEADER_LENGTH: str(len(text))}


def typed_values(t: Tensor) -> list:
    assert t.raw is not None
    if t.datatype != "BYTES":
        return np.frombuffer(t.raw, WIRE_DTYPE[t.datatype]).tolist()
    out, pos = [], 0
    while pos < len(t.raw):
        (n,) = struct.unpack_from("<I", t.raw, pos)
        out.append(t.raw[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


# ---- mutations ------------------------------------------------------------------------------------
int64s = st.integers(-(2**63), 2**63 - 1)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**400, -(10**400), 2**63, 0.5]),
    st.floats(),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_leaf,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=12,
)
OPS = (
    "extreme", "value", "cut", "k", "datatype", "version", "shape", "grow", "drop", "unknown",
    "duplicate", "parameter", "output", "model",
)  # fmt: skip
"""Mutations, the likelier first (hypothesis draws early entries of a list more often)."""
EXTREMES = [10**400, -(10**400), 2**63, -(2**63) - 1, 2**31, 1e39, float("nan"), float("inf"),
            True, None, "1", 1.5, [], {}]  # fmt: skip
"""Typed values of the wrong type or past every range (JSON can carry them all)."""


@st.composite
def calls(draw: st.DrawFn, tiny) -> Call:
    """A valid call (raw or typed contents, with or without a filter) and 0-3 mutations
    (most calls get at least one)."""
    rows = draw(st.integers(1, 3))
    users = draw(st.lists(st.integers(0, 99), min_size=rows, max_size=rows))
    filters = ["available", ""][:rows] + [""] * (rows - 2) if draw(st.booleans()) else None
    call = Call.valid(tiny, users, draw(st.integers(1, 20)), filters)
    if draw(st.sampled_from([True, False])):  # typed first: drawn more often
        call.to_typed()
    for _ in range(draw(st.sampled_from([1, 1, 2, 2, 3, 0]))):
        mutate(draw, call, draw(st.sampled_from(OPS)))
    return call


def mutate(draw: st.DrawFn, call: Call, op: str) -> None:
    t = draw(st.sampled_from(call.tensors)) if call.tensors else None
    if op == "unknown":
        name = draw(st.sampled_from(["", "History", "user", "k "]) | st.text(max_size=6))
        call.tensors.append(Tensor(name, "INT64", [call.rows, 1], b"\0" * 8 * call.rows))
    elif op == "model":
        # not empty: gRPC's "" is the default model, HTTP's is another route (404)
        call.model = draw(st.sampled_from(["demo", "other", "DEMO"]) | st.text("demo", min_size=1))
    elif op == "version":
        versions = ["1" * 5000, "9" * 19, "٣", "1.0", "-1", "x", "2", "01", "1", ""]
        call.version = draw(st.sampled_from(versions))
    elif op == "parameter":
        key = draw(st.sampled_from(["timeout", "priority", "x"]) | st.text(max_size=6))
        value = draw(st.booleans() | int64s | st.floats(allow_nan=False) | st.text(max_size=6))
        call.parameters[key] = value
        call.maybe.append(f"parameter {key}={value!r}")
    elif op == "output":
        name = draw(st.sampled_from([*OUTPUTS, "item_ids ", "x"]) | st.text(max_size=5))
        call.outputs.append(name)
    elif op == "k":
        k = draw(st.integers(-(2**31), 2**31 - 1) | st.sampled_from([0, -1, 300, 301, 10_000]))
        for k_t in call.tensors:
            if k_t.name == "k" and k_t.raw is not None and len(k_t.raw) == 4 * call.rows:
                k_t.raw = struct.pack("<i", k) * call.rows
            elif k_t.name == "k" and k_t.values is not None and len(k_t.values) == call.rows:
                k_t.values = [k] * call.rows
        call.k = k
    elif t is None:
        return
    elif op == "drop":
        call.tensors.remove(t)
    elif op == "duplicate":
        call.tensors.append(copy.deepcopy(t))
    elif op == "datatype":
        t.datatype = draw(st.sampled_from(["INT64", "INT32", "FP32", "FP64", "BYTES", "", "int64"]))
    elif op == "shape":
        t.shape = draw(st.lists(st.integers(-2, 4) | st.integers(0, 2**63 - 1), max_size=4))
    elif op in ("cut", "grow") and t.raw is not None:
        if op == "cut" and t.raw:
            t.raw = t.raw[: draw(st.integers(0, len(t.raw) - 1))]
        else:
            t.raw += draw(st.binary(min_size=1, max_size=9))
        call.maybe.append(f"{op} {t.name}")  # a cut then grown tensor may be valid again
    elif op == "value" and t.raw:
        raw = bytearray(t.raw)
        at = draw(st.integers(0, len(raw) - 1))
        raw[at : at + 4] = draw(st.binary(min_size=4, max_size=4))[: len(raw) - at]
        t.raw = bytes(raw)
        call.maybe.append(f"{t.name} bytes at {at}")
    elif op == "value" and t.values:
        t.values[draw(st.integers(0, len(t.values) - 1))] = draw(json_leaf | int64s)
        call.maybe.append(f"{t.name} value")
    elif op == "extreme" and t.values:  # one value of every typed tensor, or not
        for typed in [u for u in call.tensors if u.values and draw(st.booleans())] or [t]:
            value = draw(st.sampled_from(EXTREMES))
            typed.values[draw(st.integers(0, len(typed.values) - 1))] = value
            call.maybe.append(f"{typed.name} extreme value {value!r:.20}")
    elif op == "extreme" and t.raw and t.datatype != "BYTES":
        size = np.dtype(WIRE_DTYPE[t.datatype]).itemsize
        fill = draw(st.sampled_from([b"\xff", b"\x7f", b"\x80", b"\x00"]))  # NaN, max, min, 0
        t.raw = fill * size + t.raw[size:]
        call.maybe.append(f"{t.name} extreme bytes")


def judge(
    call: Call, code: str, message: str = "", shape: list[int] | None = None, loose: bool = False
) -> None:
    """``code``: a gRPC status name or an HTTP status as text; ``shape``: item_ids' shape;
    ``loose``: the call was changed beyond what ``must_fail`` knows (random JSON)."""
    must_fail = [] if loose else call.must_fail
    if code in ("OK", "200"):
        event("answered")
        assert not must_fail, f"answered a call that must be refused: {must_fail}"
        assert shape is not None and shape[0] == call.rows, shape
        assert shape[1] == call.k or call.maybe, (shape, call.k)
        return
    where = message.split(":", 1)[0]
    event(f"{code} {where}")
    if code in ("DEADLINE_EXCEEDED", "504"):  # Triton's timeout parameter: microseconds
        timeout = call.parameters.get("timeout")
        assert isinstance(timeout, int) and 0 < timeout < 10**6, (code, message, timeout)
        return
    assert code in ("INVALID_ARGUMENT", "NOT_FOUND", "400", "404", "413"), (code, message)
    assert where in PREFIXES, f"{code} {message[:200]!r} names no field"
    assert must_fail or call.maybe, f"refused a valid call: {code} {message[:200]!r}"


def replace_somewhere(draw: st.DrawFn, doc: object) -> bool:
    """Replaces one value at a random path of the JSON ``doc`` with random JSON; False when
    ``doc`` has no place for it."""
    node = doc
    for _ in range(draw(st.integers(1, 4))):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return False
        key = draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, dict | list) and child and draw(st.booleans()):
            node = child
            continue
        node[key] = draw(json_values)
        return True
    return False


def post(
    server: Server,
    path: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    """-> (status, headers, body) of one raw POST to the server's HTTP port, on a new
    connection."""
    conn = http.client.HTTPConnection(*server.addresses.http.split(":"), timeout=timeout)
    try:
        conn.request("POST", path, body, headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()
