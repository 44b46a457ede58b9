"""The KServe v2 / Triton inference protocol, independent of the transport.

Both front ends (:mod:`serving.frontends.kserve_grpc`, :mod:`serving.frontends.kserve_http`) turn their wire format
into :class:`WireTensor` s and call :func:`parse`, which checks every input against the tensor
interface of ``serving.types`` and splits the batch into one
:class:`~serving.types.RecRequest` per row (so rows of different calls share batches)::

    spec = resolve(state, model, version)       # NOT_FOUND; F, Dd, K range, B limit
    reqs = parse(tensors, spec, deadline=...)   # B RecRequests, or RequestError
    futures = submit_rows(state, reqs)          # through state.submit: all rows or none
    ... wait for every future ...
    outputs = render(results, requested)        # item_ids int64 [B, K], scores fp32 [B, K]

Rows are checked here, at the edge; the runner checks each row again against the model
(id ranges, filter attributes) when it is submitted.

Every :class:`~serving.types.RequestError` starts with the input it is about (``dense: ...``)
or the part of the message that is wrong (``inputs:``, ``raw_input_contents:``, ``outputs:``,
``parameters:``, ``version:``). An unknown model or version is
:class:`~serving.types.ModelNotFoundError`.

Wire layout (KServe v2): every tensor is ``[B, ...dims]`` row-major; raw contents are
little-endian; a BYTES element is a 4-byte little-endian length then the bytes.
"""

from __future__ import annotations

import math
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from serving.engine.state import ServingState
from serving.limits import LimitsConfig
from serving.raw_ids import decode_text, raw_item_ids
from serving.types import (
    DATATYPES,
    MAX_K,
    OUTPUTS,
    RAW_INPUTS,
    RAW_OUTPUTS,
    ModelNotFoundError,
    RecRequest,
    RecResult,
    RequestError,
)

SERVER_NAME = "recserve"
EXTENSIONS = ("binary_tensor_data", "model_configuration", "parameters")
NUMPY: dict[str, np.dtype[Any]] = {
    "INT64": np.dtype("<i8"),
    "INT32": np.dtype("<i4"),
    "FP32": np.dtype("<f4"),
}
"""Wire dtype of every fixed-size datatype the interface uses (BYTES is variable)."""
_INT_RANGE: dict[str, tuple[int, int]] = {
    "INT64": (-(2**63), 2**63 - 1),
    "INT32": (-(2**31), 2**31 - 1),
}
_FLOAT_MAX = sys.float_info.max
NO_DEADLINE_S = 1e7
"""A time left beyond this (~4 months) is no deadline at all."""
_PAD: dict[str, float] = {"item_ids": -1, "scores": -np.inf}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the interface; ``dims`` exclude the batch dim (``-1``: any size)."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """What parsing needs to know of the loaded model."""

    name: str
    version: int
    categorical: int
    """F: categorical user features."""
    dense: int
    """Dd: dense user features."""
    max_k: int
    """Largest K a request may ask for (``MAX_K``, items in the index)."""
    max_batch_size: int
    """Most rows (B) in one call, as Triton enforces ``max_batch_size``."""
    platform: str = "pytorch"
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    """Request size limits (``[limits]``): a filter is checked against them before parsing."""
    raw_ids: bool = False
    """The model has id maps: ``raw_history`` in, ``raw_item_ids`` out (``history`` optional)."""

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        raw = (TensorSpec("raw_history", DATATYPES["raw_history"], (-1,), optional=True),)
        return (
            TensorSpec("history", DATATYPES["history"], (-1,), optional=self.raw_ids),
            TensorSpec("categorical", DATATYPES["categorical"], (self.categorical,)),
            TensorSpec("dense", DATATYPES["dense"], (self.dense,)),
            TensorSpec("k", DATATYPES["k"], (1,)),
            TensorSpec("filter", DATATYPES["filter"], (1,), optional=True),
            *(raw if self.raw_ids else ()),
        )

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        names = OUTPUTS + RAW_OUTPUTS if self.raw_ids else OUTPUTS
        return tuple(TensorSpec(name, DATATYPES[name], (-1,)) for name in names)


@dataclass
class WireTensor:
    """One input as it arrived: ``raw`` bytes (binary / ``raw_input_contents``) or ``values``
    (typed contents: a flat sequence, or JSON lists nested any way)."""

    name: str
    datatype: str
    shape: Sequence[Any]
    raw: bytes | None = None
    values: Any = None


@dataclass
class OutputTensor:
    name: str
    datatype: str
    array: np.ndarray

    @property
    def shape(self) -> list[int]:
        return list(self.array.shape)

    def raw(self) -> bytes:
        """Row-major little-endian bytes; BYTES: each element's 4-byte length, then its UTF-8."""
        if self.datatype == "BYTES":
            parts = [s.encode("utf-8") for s in self.array.reshape(-1)]
            return b"".join(struct.pack("<I", len(p)) + p for p in parts)
        return self.array.astype(NUMPY[self.datatype], copy=False).tobytes()


# ---- the model ---------------------------------------------------------------------------------
def resolve(state: ServingState, model: str, version: str) -> ModelSpec:
    """The spec of the loaded model if ``model`` / ``version`` (``""``: the latest) name it;
    raises :class:`ModelNotFoundError` or :class:`RequestError` (a version that is no number)."""
    # at most 18 digits: an int64, and int() refuses over 4300 digits with a ValueError
    if version and not (version.isascii() and version.isdigit() and len(version) <= 18):
        raise RequestError(f"version: {_short(version)} is not a version number")
    state.host.check_target(model, int(version) if version else None)
    return model_spec(state)


def model_spec(state: ServingState) -> ModelSpec:
    runner = state.host.current()
    config = loaded_config(state)
    platform = (config.platform or config.backend) if config is not None else ""
    return ModelSpec(
        name=runner.name,
        version=runner.version,
        categorical=len(runner.features),
        dense=runner.dense_dim,
        max_k=min(MAX_K, runner.num_items, runner.model.index.ntotal),
        max_batch_size=state.batcher.policy.max_batch_size,
        platform=platform or "pytorch",
        limits=state.limits,
        raw_ids=runner.item_map is not None,
    )


def loaded_config(state: ServingState) -> mc.ModelConfig | None:
    """The served version's ``config.pbtxt``; None before a version loads or without one."""
    loaded = state.host.loaded
    config = None if loaded is None else loaded.config
    return config if isinstance(config, mc.ModelConfig) else None


def model_config(state: ServingState, spec: ModelSpec) -> mc.ModelConfig:
    """The loaded version's ``config.pbtxt``; one built from the interface when it has none."""
    config = loaded_config(state)
    if config is not None:
        return with_raw_ids(config) if spec.raw_ids else config
    policy = state.batcher.policy

    def tensor(t: TensorSpec) -> dict[str, Any]:
        dt = "TYPE_STRING" if t.datatype == "BYTES" else f"TYPE_{t.datatype}"
        return {"name": t.name, "data_type": mc.DataType.Value(dt), "dims": list(t.dims)}

    return mc.ModelConfig(
        name=spec.name,
        platform=spec.platform,
        max_batch_size=spec.max_batch_size,
        input=[mc.ModelInput(**tensor(t), optional=t.optional) for t in spec.inputs],
        output=[mc.ModelOutput(**tensor(t)) for t in spec.outputs],
        dynamic_batching=mc.ModelDynamicBatching(
            preferred_batch_size=list(policy.preferred_sizes),
            max_queue_delay_microseconds=round(policy.max_queue_delay_s * 1e6),
            default_queue_policy=mc.ModelQueuePolicy(max_queue_size=policy.max_queue_size),
        ),
    )


def with_raw_ids(config: mc.ModelConfig) -> mc.ModelConfig:
    """``config`` declaring the raw id tensors (a version published before configs declared
    them gets them from its model's id maps); ``config`` itself when it declares them."""
    if any(t.name == "raw_history" for t in config.input):
        return config
    out = mc.ModelConfig()
    out.CopyFrom(config)
    for t in out.input:
        if t.name == "history":
            t.optional = True
    out.input.add(name="raw_history", data_type=mc.TYPE_STRING, dims=[-1], optional=True)
    out.output.add(name="raw_item_ids", data_type=mc.TYPE_STRING, dims=[-1])
    return out


def server_version() -> str:
    try:
        return metadata.version(SERVER_NAME)
    except metadata.PackageNotFoundError:
        return "0"


# ---- parsing -----------------------------------------------------------------------------------
def deadline_from(parameters: Mapping[str, Any], remaining: float | None = None) -> float | None:
    """Absolute ``time.monotonic()`` deadline from Triton's ``timeout`` parameter (µs) and the
    transport's own time left (seconds), whichever is sooner."""
    now = time.monotonic()
    # grpc reports a call without a deadline as a time left of ~forever: no deadline
    deadline = None if remaining is None or remaining > NO_DEADLINE_S else now + remaining
    timeout = parameters.get("timeout")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
            raise RequestError(f"parameters: timeout must be microseconds >= 0, got {timeout!r}")
        if 0 < timeout <= NO_DEADLINE_S * 1e6:
            mine = now + timeout / 1e6
            deadline = mine if deadline is None else min(deadline, mine)
    return deadline


def parse(
    tensors: Sequence[WireTensor], spec: ModelSpec, *, deadline: float | None = None
) -> list[RecRequest]:
    """The inputs of one call -> one :class:`RecRequest` per batch row (validated)."""
    by_name: dict[str, WireTensor] = {}
    known = [t.name for t in spec.inputs]
    for t in tensors:
        if t.name in RAW_INPUTS and not spec.raw_ids:
            raise RequestError(
                f"{t.name}: {spec.name} version {spec.version} has no id maps (it was not "
                "trained on imported data): send history, the dense item ids"
            )
        if t.name not in known:
            raise RequestError(
                f"inputs: unexpected input {t.name!r} (inputs are {', '.join(known)})"
            )
        if t.name in by_name:
            raise RequestError(f"{t.name}: given twice")
        by_name[t.name] = t
    arrays: dict[str, np.ndarray] = {}
    batch: int | None = None
    for ts in spec.inputs:
        given = by_name.get(ts.name)
        if given is None:
            if ts.optional:
                continue
            raise RequestError(f"{ts.name}: missing input (inputs are {', '.join(known)})")
        shape = _check_shape(given, ts, spec.max_batch_size)
        if batch is None:
            batch = shape[0]
        elif shape[0] != batch:
            first = next(n for n in arrays)
            raise RequestError(f"{ts.name}: batch size {shape[0]} disagrees with {first}'s {batch}")
        arrays[ts.name] = decode(given, shape)
    assert batch is not None  # k is required
    histories, raw = _histories(arrays, batch)
    ks = arrays["k"].reshape(batch)
    filters = _filters(arrays.get("filter"), batch, spec.limits)
    reqs = []
    for b in range(batch):
        k = int(ks[b])
        if not 1 <= k <= spec.max_k:
            raise RequestError(f"k: must be in [1, {spec.max_k}], got {k}{_row(b, batch)}")
        reqs.append(
            RecRequest(
                history=histories[b],
                categorical=arrays["categorical"][b],
                dense=arrays["dense"][b],
                k=k,
                filter=filters[b],
                deadline=deadline,
                model=spec.name,
                raw_history=None if raw is None else raw[b],
            )
        )
    return reqs


def _histories(arrays: dict[str, np.ndarray], batch: int) -> tuple[np.ndarray, np.ndarray | None]:
    """-> (``history`` int64 [B, H], ``raw_history`` str [B, H'] or None): exactly one of the
    two inputs is given (``raw_history`` only where the spec has it)."""
    hist, raw = arrays.get("history"), arrays.get("raw_history")
    if hist is not None and raw is not None:
        raise RequestError("raw_history: give history or raw_history, not both")
    if raw is not None:  # the runner maps each row with its version's item map
        return np.empty((batch, 0), dtype=np.int64), decode_text(raw)
    if hist is None:
        raise RequestError("history: missing input (give history or raw_history)")
    return hist, None


def _row(b: int, batch: int) -> str:
    return f" (batch row {b})" if batch > 1 else ""


def _check_shape(t: WireTensor, ts: TensorSpec, max_batch: int) -> list[int]:
    if t.datatype != ts.datatype:
        raise RequestError(f"{ts.name}: expected datatype {ts.datatype}, got {t.datatype!r}")
    want = "[" + ", ".join(["B", *("-1" if d < 0 else str(d) for d in ts.dims)]) + "]"
    shape = list(t.shape)
    if len(shape) != 1 + len(ts.dims) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise RequestError(f"{ts.name}: expected shape {want}, got {shape}")
    if any(d >= 0 and d != got for d, got in zip(ts.dims, shape[1:], strict=True)):
        raise RequestError(f"{ts.name}: expected shape {want}, got {shape}")
    if not 1 <= shape[0] <= max_batch:
        raise RequestError(
            f"{ts.name}: batch size must be in [1, max_batch_size={max_batch}], got {shape[0]}"
        )
    return shape


def decode(t: WireTensor, shape: list[int]) -> np.ndarray:
    """``t``'s contents as an array of ``shape`` (datatype and shape already checked)."""
    count = math.prod(shape)
    if t.raw is None and t.values is None:
        raise RequestError(f"{t.name}: has no contents")
    if t.raw is not None and t.values is not None:
        raise RequestError(f"{t.name}: has both raw and typed contents")
    if t.datatype == "BYTES":
        strings = _split_bytes(t.raw, count, t.name) if t.raw is not None else _strings(t, count)
        out = np.empty(count, dtype=object)
        out[:] = strings
        return out.reshape(shape)
    dtype = NUMPY[t.datatype]
    if t.raw is not None:
        if len(t.raw) != count * dtype.itemsize:
            raise RequestError(
                f"{t.name}: raw contents hold {len(t.raw)} bytes, shape {shape} of "
                f"{t.datatype} needs {count * dtype.itemsize}"
            )
        # a writable native copy: the model side hands rows to torch.from_numpy
        return np.frombuffer(t.raw, dtype=dtype).astype(dtype.newbyteorder("=")).reshape(shape)
    flat: list[Any] = _flatten(t.values, count, t.name)
    if t.datatype in _INT_RANGE:
        lo, hi = _INT_RANGE[t.datatype]
        bad = [v for v in flat if not (_is_int(v) and lo <= v <= hi)]
    else:  # an int past float64 (JSON allows it) makes numpy raise OverflowError
        bad = [v for v in flat if not _is_number(v) or (_is_int(v) and abs(v) > _FLOAT_MAX)]
    if bad:
        raise RequestError(f"{t.name}: {_short(bad[0])} is not an {t.datatype} value")
    with np.errstate(over="ignore"):  # an FP32 overflow is infinity: dense refuses it later
        return np.array(flat, dtype=dtype.newbyteorder("=")).reshape(shape)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _flatten(values: Any, count: int, name: str) -> list[Any]:
    """Typed contents -> a flat list of ``count`` leaves (JSON may nest lists any way)."""
    if not isinstance(values, list | tuple):
        raise RequestError(f"{name}: data must be a list, got {type(values).__name__}")
    flat: list[Any] = []
    stack = [iter(values)]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list | tuple):
            stack.append(iter(item))
        else:
            flat.append(item)
            if len(flat) > count:
                break
    if len(flat) != count:
        got = f"more than {count}" if len(flat) > count else str(len(flat))
        raise RequestError(f"{name}: shape needs {count} values, got {got}")
    return flat


_END = object()


def _split_bytes(raw: bytes, count: int, name: str) -> list[bytes]:
    """Triton's serialized BYTES tensor -> ``count`` elements."""
    out: list[bytes] = []
    pos = 0
    while pos < len(raw) and len(out) < count:
        if pos + 4 > len(raw):
            raise RequestError(f"{name}: BYTES element {len(out)}: length prefix is cut short")
        (size,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + size > len(raw):
            raise RequestError(
                f"{name}: BYTES element {len(out)} claims {size} bytes, {len(raw) - pos} left"
            )
        out.append(raw[pos : pos + size])
        pos += size
    if len(out) != count or pos != len(raw):
        raise RequestError(
            f"{name}: raw contents do not hold exactly {count} BYTES elements "
            f"({len(out)} elements in {pos} of {len(raw)} bytes)"
        )
    return out


def _strings(t: WireTensor, count: int) -> list[bytes]:
    out = []
    for v in _flatten(t.values, count, t.name):
        if isinstance(v, str):
            out.append(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, bytes):
            out.append(v)
        else:
            raise RequestError(f"{t.name}: {_short(v)} is not a BYTES value")
    return out


def _filters(values: np.ndarray | None, batch: int, limits: LimitsConfig) -> list[str | None]:
    """Each row's filter text, checked: its size against ``limits`` before it is decoded or
    parsed, then its syntax, so a bad row refuses the call before any row is queued (the
    model's attributes are the runner's check)."""
    if values is None:
        return [None] * batch
    out: list[str | None] = []
    for b, raw in enumerate(values.reshape(batch)):
        limits.check_filter_bytes(len(raw), _row(b, batch))
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise RequestError(f"filter: not UTF-8 text{_row(b, batch)}") from None
        limits.parse_filter(text, _row(b, batch))
        out.append(text or None)
    return out


# ---- running -----------------------------------------------------------------------------------
def submit_rows(state: ServingState, reqs: list[RecRequest]) -> list[Future[RecResult]]:
    """Queues every row, or none: when a row is refused, the ones queued leave the queue."""
    futures: list[Future[RecResult]] = []
    for b, req in enumerate(reqs):
        try:
            futures.append(state.submit(req))
        except (RequestError, ModelNotFoundError) as e:
            cancel(futures)
            raise type(e)(f"{e}{_row(b, len(reqs))}") from None
        except BaseException:
            cancel(futures)
            raise
    return futures


def cancel(futures: Sequence[Future[Any]]) -> None:
    for f in futures:
        f.cancel()


# ---- rendering ---------------------------------------------------------------------------------
def requested_outputs(names: Sequence[str], spec: ModelSpec) -> list[str]:
    """The outputs a call asks for (none named: all of ``spec``'s), checked."""
    known = [t.name for t in spec.outputs]
    for n in names:
        if n not in known:
            raise RequestError(f"outputs: unknown output {n!r} (outputs are {', '.join(known)})")
    if len(set(names)) != len(names):
        raise RequestError("outputs: an output is asked for twice")
    return list(names) if names else known


def render(results: Sequence[RecResult], names: Sequence[str]) -> list[OutputTensor]:
    """One result per row -> ``item_ids int64 [B, K]``, ``scores float32 [B, K]`` and
    ``raw_item_ids`` text ``[B, K]`` (rows shorter than the longest K are padded with -1 /
    -inf / "")."""
    k = max(len(r.item_ids) for r in results)
    out = []
    arrays: dict[str, np.ndarray] = {}
    for name in ("item_ids", *names):
        if name in arrays or name == "raw_item_ids":
            continue
        array = np.full((len(results), k), _PAD[name], dtype=NUMPY[DATATYPES[name]])  # [B, K]
        for b, r in enumerate(results):
            row = getattr(r, name)
            array[b, : len(row)] = row
        arrays[name] = array
    for name in names:
        array = _raw_ids(results, arrays["item_ids"]) if name == "raw_item_ids" else arrays[name]
        out.append(OutputTensor(name, DATATYPES[name], array))
    return out


def _raw_ids(results: Sequence[RecResult], ids: np.ndarray) -> np.ndarray:
    """``ids [B, K]`` -> their raw ids ``str [B, K]``: one take per item map among the rows
    (one, unless the call straddled a hot swap)."""
    out = np.empty(ids.shape, dtype=object)  # [B, K]
    for item_map in {id(r.item_map): r.item_map for r in results}.values():
        rows = [b for b, r in enumerate(results) if r.item_map is item_map]
        out[rows] = raw_item_ids(ids[rows], item_map)
    return out
