"""KServe v2 inputs -> one :class:`~serving.types.RecRequest` per batch row: every input checked
against the model's :class:`~serving.frontends.kserve_spec.ModelSpec` (datatype, shape, values),
BYTES split, filters checked against the limits before they are parsed (see
:mod:`serving.frontends.kserve` for the whole flow).

Wire layout (KServe v2): every tensor is ``[B, ...dims]`` row-major; raw contents are
little-endian; a BYTES element is a 4-byte little-endian length then the bytes.
"""

from __future__ import annotations

import math
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.frontends.kserve_spec import ModelSpec, TensorSpec, short_repr
from serving.limits import LimitsConfig
from serving.raw_ids import decode_text
from serving.types import RAW_INPUTS, RecRequest, RequestError

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
SEEN_INPUTS = ("seen", "raw_seen")
"""Inputs whose length ``limits.max_seen`` bounds."""
NO_DEADLINE_S = 1e7
"""A time left beyond this (~4 months) is no deadline at all."""


@dataclass
class WireTensor:
    """One input as it arrived: ``raw`` bytes (binary / ``raw_input_contents``) or ``values``
    (typed contents: a flat sequence, or JSON lists nested any way)."""

    name: str
    datatype: str
    shape: Sequence[Any]
    raw: bytes | None = None
    values: Any = None


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


def recall_target_from(parameters: Mapping[str, Any]) -> float:
    """The request parameter ``recall_target`` (a number in (0, 1]; absent: 0, the model's
    settings), for every row of the call (``retrieval/index/targets.py``)."""
    target = parameters.get("recall_target", 0.0)
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 <= target <= 1:
        raise RequestError(f"parameters: recall_target must be a number in (0, 1], got {target!r}")
    return float(target)


def parse(
    tensors: Sequence[WireTensor],
    spec: ModelSpec,
    *,
    deadline: float | None = None,
    target: float = 0.0,
) -> list[RecRequest]:
    """The inputs of one call -> one :class:`RecRequest` per batch row (validated), each with
    the call's recall ``target``."""
    by_name: dict[str, WireTensor] = {}
    known = [t.name for t in spec.inputs]
    for t in tensors:
        if t.name in RAW_INPUTS and not spec.raw_ids:
            dense = t.name.removeprefix("raw_")  # raw_history -> history, raw_seen -> seen
            raise RequestError(
                f"{t.name}: {spec.name} version {spec.version} has no id maps (it was not "
                f"trained on imported data): send {dense}, the dense item ids"
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
        if ts.name in SEEN_INPUTS:  # [B, S]: its length bounds the work, refused before decoding
            spec.limits.check_seen(shape[1], ts.name)
        if batch is None:
            batch = shape[0]
        elif shape[0] != batch:
            first = next(n for n in arrays)
            raise RequestError(f"{ts.name}: batch size {shape[0]} disagrees with {first}'s {batch}")
        arrays[ts.name] = decode(given, shape)
    assert batch is not None  # k is required
    histories, raw = _histories(arrays, batch)
    seen, raw_seen = _seen(arrays)
    ks = arrays["k"].reshape(batch)
    users = arrays["user"].reshape(batch) if "user" in arrays else None
    filters = _filters(arrays.get("filter"), batch, spec.limits)
    reqs = []
    for b in range(batch):
        k = int(ks[b])
        if not 1 <= k <= spec.max_k:
            raise RequestError(f"k: must be in [1, {spec.max_k}], got {k}{row_note(b, batch)}")
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
                seen=None if seen is None else seen[b],
                raw_seen=None if raw_seen is None else raw_seen[b],
                recall_target=target,
                user=-1 if users is None else int(users[b]),
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


def _seen(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """-> (``seen`` int64 [B, S] (``-1`` pads) or None, ``raw_seen`` str [B, S] or None): at
    most one of the two is given (the runner checks the ids and maps the raw ones)."""
    seen, raw = arrays.get("seen"), arrays.get("raw_seen")
    if seen is not None and raw is not None:
        raise RequestError("raw_seen: give seen or raw_seen, not both")
    return seen, None if raw is None else decode_text(raw, "raw_seen")


def row_note(b: int, batch: int) -> str:
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
        raise RequestError(f"{t.name}: {short_repr(bad[0])} is not an {t.datatype} value")
    with np.errstate(over="ignore"):  # an FP32 overflow is infinity: dense refuses it later
        return np.array(flat, dtype=dtype.newbyteorder("=")).reshape(shape)


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
            raise RequestError(f"{t.name}: {short_repr(v)} is not a BYTES value")
    return out


def _filters(values: np.ndarray | None, batch: int, limits: LimitsConfig) -> list[str | None]:
    """Each row's filter text, checked: its size against ``limits`` before it is decoded or
    parsed, then its syntax, so a bad row refuses the call before any row is queued (the
    model's attributes are the runner's check)."""
    if values is None:
        return [None] * batch
    out: list[str | None] = []
    for b, raw in enumerate(values.reshape(batch)):
        limits.check_filter_bytes(len(raw), row_note(b, batch))
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise RequestError(f"filter: not UTF-8 text{row_note(b, batch)}") from None
        limits.parse_filter(text, row_note(b, batch))
        out.append(text or None)
    return out
