"""The messages between front-end processes and the engine process: typed, never pickled.

Every message is one ZeroMQ multipart message: a small JSON header (a ``dict`` with its kind in
``"t"``) and then raw buffers. Arrays travel as their bytes, one frame per field for all the
rows of a call (rows concatenated, each row's length in the header), and are read back with
``np.frombuffer`` over the received frame: no copy and no pickle either way. Text arrays (raw
ids) travel in KServe's BYTES layout (4-byte little-endian length, then UTF-8).

=========  ==========  ===========================================================  =========
kind       direction   header                                                       frames
=========  ==========  ===========================================================  =========
``ping``   fe -> eng   ``fe``: the front end's routing id                           none
``pong``   eng -> fe   ``epoch`` (one per engine start), ``ready``, ``info``        config
``sub``    fe -> eng   ``id``, ``rows``: each row's scalars, ``arrays``: name ->    arrays
                       (dtype, per-row lengths)
``cancel`` fe -> eng   ``id``: the call's rows leave the queue                      none
``res``    eng -> fe   ``id``, ``rows``: each ``{"ok": {...}}`` or ``{"err": [..]}``  ids, scores, raw ids
``err``    eng -> fe   ``id``, ``err``: ``[kind, message]``, the whole call refused    none
``upd``    fe -> eng   ``id``, ``kind``, ``update_id``, ``deadline``                 request
``updr``   eng -> fe   ``id``, ``err`` (absent on success)                          reply
=========  ==========  ===========================================================  =========

Deadlines are absolute ``time.monotonic()`` seconds: the clock is the machine's
(``CLOCK_MONOTONIC``), the same in every process of the group, so a deadline crosses as is.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from concurrent.futures import CancelledError
from typing import Any

import numpy as np

from serving.engine.batching import BatchPolicy
from serving.engine.client import ModelInfo
from serving.types import (
    DeadlineExceededError,
    ModelNotFoundError,
    QueueFullError,
    RecRequest,
    RecResult,
    RequestError,
    UnavailableError,
)

Frames = list[Any]
"""A multipart message: ``bytes`` / buffers out, ``zmq.Frame`` s (``.buffer``) in."""

ERRORS: dict[str, type[BaseException]] = {
    "invalid_argument": RequestError,
    "not_found": ModelNotFoundError,
    "queue_full": QueueFullError,
    "deadline_exceeded": DeadlineExceededError,
    "unavailable": UnavailableError,
    "cancelled": CancelledError,
}
"""The serving errors that cross as themselves; anything else arrives as ``RuntimeError``
(INTERNAL), its message kept."""
_KIND = {cls: kind for kind, cls in ERRORS.items()}
_ARRAYS = (("history", "<i8"), ("categorical", "<i8"), ("dense", "<f4"), ("seen", "<i8"))
_TEXTS = ("raw_history", "raw_seen")
_SCALARS = ("k", "filter", "user_id", "deadline", "model", "version", "recall_target", "user")


_DUMPS = json.JSONEncoder(separators=(",", ":")).encode
"""One encoder for every message: ``json.dumps`` with options builds a new one per call."""
_LOADS = json.JSONDecoder().decode


def header(frames: Frames) -> dict[str, Any]:
    """The JSON header of a received message."""
    first = frames[0]
    head = _LOADS(bytes(first.buffer if hasattr(first, "buffer") else first).decode())
    if not isinstance(head, dict):
        raise ValueError(f"message header: a JSON object expected, got {type(head).__name__}")
    return head


def message(head: dict[str, Any], *buffers: Any) -> Frames:
    return [_DUMPS(head).encode(), *buffers]


# ---- errors --------------------------------------------------------------------------------------
def error_of(exc: BaseException) -> list[str]:
    """``[kind, message]`` of an error (kind ``internal`` for one that is no serving error)."""
    for cls in type(exc).__mro__:
        if cls in _KIND:
            return [_KIND[cls], str(exc)]
    return ["internal", f"{type(exc).__name__}: {exc}"]


def exception_of(err: Sequence[str]) -> BaseException:
    kind, text = err
    return ERRORS.get(kind, RuntimeError)(text)


# ---- requests ------------------------------------------------------------------------------------
def encode_requests(head: dict[str, Any], reqs: Sequence[RecRequest]) -> Frames:
    """The rows of one call -> a ``sub`` message (``head`` gives ``fe`` and ``id``)."""
    if len(reqs) == 1:
        return _encode_one(head, reqs[0])
    arrays: dict[str, Any] = {}
    buffers: list[Any] = []
    for name, dtype in _ARRAYS:
        parts = [getattr(r, name) for r in reqs]
        if all(p is None for p in parts):
            continue
        lengths = [-1 if p is None else len(p) for p in parts]
        given = [np.asarray(p, dtype=dtype).reshape(-1) for p in parts if p is not None]
        arrays[name] = [dtype, lengths]
        buffers.append(np.concatenate(given) if len(given) > 1 else given[0])
    for name in _TEXTS:
        parts = [getattr(r, name) for r in reqs]
        if all(p is None for p in parts):
            continue
        arrays[name] = ["BYTES", [-1 if p is None else len(p) for p in parts]]
        buffers.append(encode_text([s for p in parts if p is not None for s in p]))
    rows = [{n: getattr(r, n) for n in _SCALARS} for r in reqs]
    return message({**head, "t": "sub", "rows": rows, "arrays": arrays}, *buffers)


def decode_requests(head: dict[str, Any], frames: Frames) -> list[RecRequest]:
    """A ``sub`` message -> its rows (the arrays are views of the received frames)."""
    rows = head["rows"]
    if len(rows) == 1:
        return [_decode_one(head, frames)]
    fields: dict[str, list[Any]] = {}
    for frame, (name, (dtype, lengths)) in zip(frames[1:], head["arrays"].items(), strict=True):
        flat = (
            decode_text(_buffer(frame))
            if dtype == "BYTES"
            else np.frombuffer(_buffer(frame), dtype=dtype)
        )
        fields[name] = _split(flat, lengths)
    reqs = []
    for b, row in enumerate(rows):
        arrays = {name: parts[b] for name, parts in fields.items()}
        reqs.append(
            RecRequest(
                history=arrays.get("history", _EMPTY_IDS),
                categorical=arrays["categorical"],
                dense=arrays["dense"],
                seen=arrays.get("seen"),
                raw_history=arrays.get("raw_history"),
                raw_seen=arrays.get("raw_seen"),
                **row,
            )
        )
    return reqs


_EMPTY_IDS = np.zeros(0, dtype=np.int64)
_DTYPES = {dtype: np.dtype(dtype) for _, dtype in _ARRAYS}


def _encode_one(head: dict[str, Any], req: RecRequest) -> Frames:
    """:func:`encode_requests` of a one-row call (most calls): the same message, built without
    the per-field lists and concatenations of many rows."""
    arrays: dict[str, Any] = {}
    buffers: list[Any] = []
    for name, dtype in _ARRAYS:
        part = getattr(req, name)
        if part is not None:
            flat = np.asarray(part, dtype=_DTYPES[dtype]).reshape(-1)
            arrays[name] = [dtype, [len(flat)]]
            buffers.append(flat)
    for name in _TEXTS:
        part = getattr(req, name)
        if part is not None:
            arrays[name] = ["BYTES", [len(part)]]
            buffers.append(encode_text(part))
    row = {n: getattr(req, n) for n in _SCALARS}
    return message({**head, "t": "sub", "rows": [row], "arrays": arrays}, *buffers)


def _decode_one(head: dict[str, Any], frames: Frames) -> RecRequest:
    """:func:`decode_requests` of a one-row call: each frame is the row's whole array."""
    arrays: dict[str, Any] = {}
    for frame, (name, (dtype, lengths)) in zip(frames[1:], head["arrays"].items(), strict=True):
        if lengths[0] < 0:
            continue
        buf = _buffer(frame)
        arrays[name] = decode_text(buf) if dtype == "BYTES" else np.frombuffer(buf, dtype=dtype)
        if len(arrays[name]) != lengths[0]:
            raise ValueError(f"{name}: {len(arrays[name])} values, the header says {lengths[0]}")
    return RecRequest(
        history=arrays.get("history", _EMPTY_IDS),
        categorical=arrays["categorical"],
        dense=arrays["dense"],
        seen=arrays.get("seen"),
        raw_history=arrays.get("raw_history"),
        raw_seen=arrays.get("raw_seen"),
        **head["rows"][0],
    )


def _split(flat: np.ndarray, lengths: list[int]) -> list[np.ndarray | None]:
    out: list[np.ndarray | None] = []
    at = 0
    for n in lengths:
        if n < 0:
            out.append(None)
            continue
        out.append(flat[at : at + n])
        at += n
    return out


# ---- results -------------------------------------------------------------------------------------
def encode_results(head: dict[str, Any], outcomes: Sequence[RecResult | BaseException]) -> Frames:
    """One outcome per row -> a ``res`` message: ids ``int64`` and scores ``float32`` of the
    rows that succeeded, concatenated; their raw ids rendered when the version has id maps."""
    from serving.raw_ids import raw_item_ids

    rows: list[dict[str, Any]] = []
    ids, scores, raw = [], [], []
    for out in outcomes:
        if isinstance(out, BaseException):
            rows.append({"err": error_of(out)})
            continue
        rows.append(
            {
                "ok": [out.model, out.version, out.partial, out.missing, len(out.item_ids)],
                "raw": out.item_map is not None,
            }
        )
        ids.append(out.item_ids)
        scores.append(out.scores)
        if out.item_map is not None:
            raw.extend(raw_item_ids(out.item_ids.reshape(1, -1), out.item_map)[0].tolist())
    cat_ids = _joined(ids, _NO_IDS)
    cat_scores = _joined(scores, _NO_SCORES)
    return message(
        {**head, "t": "res", "rows": rows},
        cat_ids.astype("<i8", copy=False),
        cat_scores.astype("<f4", copy=False),
        encode_text(raw),
    )


_NO_IDS = np.zeros(0, np.int64)
_NO_SCORES = np.zeros(0, np.float32)


def _joined(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
    """``parts`` end to end (the one part itself: no copy for a one-row answer)."""
    if len(parts) == 1:
        return np.ascontiguousarray(parts[0]).reshape(-1)
    return np.concatenate(parts) if parts else empty


def decode_results(head: dict[str, Any], frames: Frames) -> list[RecResult | BaseException]:
    ids = np.frombuffer(_buffer(frames[1]), dtype="<i8")
    scores = np.frombuffer(_buffer(frames[2]), dtype="<f4")
    raw = decode_text(_buffer(frames[3]))
    out: list[RecResult | BaseException] = []
    at = raw_at = 0
    for row in head["rows"]:
        if "err" in row:
            out.append(exception_of(row["err"]))
            continue
        model, version, partial, missing, k = row["ok"]
        raw_ids = None
        if row["raw"]:
            raw_ids = raw[raw_at : raw_at + k]
            raw_at += k
        out.append(
            RecResult(
                ids[at : at + k],
                scores[at : at + k],
                model,
                version,
                partial=partial,
                missing=missing,
                raw_item_ids=raw_ids,
            )
        )
        at += k
    return out


# ---- the model -----------------------------------------------------------------------------------
def encode_info(info: ModelInfo | None) -> tuple[dict[str, Any] | None, bytes]:
    """``(header field, config frame)`` of the served version (None: none loaded)."""
    if info is None:
        return None, b""
    p = info.policy
    policy = [p.max_batch_size, p.max_queue_delay_s, p.max_queue_size, list(p.preferred_sizes)]
    fields = {
        "name": info.name,
        "version": info.version,
        "categorical": info.categorical,
        "dense": info.dense,
        "max_k": info.max_k,
        "raw_ids": info.raw_ids,
        "seen_store": info.seen_store,
        "platform": info.platform,
        "policy": policy,
        "config": info.config is not None,
    }
    config = b"" if info.config is None else info.config.SerializeToString()
    return fields, config


def decode_info(fields: dict[str, Any] | None, config: Any) -> ModelInfo | None:
    """The :class:`ModelInfo` of a ``pong`` (``config``: its serialized ``config.pbtxt``)."""
    if fields is None:
        return None
    mbs, delay, size, preferred = fields.pop("policy")
    has_config = fields.pop("config")
    return ModelInfo(
        **fields,
        policy=BatchPolicy(mbs, delay, size, tuple(preferred)),
        config=bytes(_buffer(config)) if has_config else None,
    )


# ---- text ----------------------------------------------------------------------------------------
def encode_text(values: Sequence[str]) -> bytes:
    """Strings -> KServe BYTES: each one's 4-byte little-endian length, then its UTF-8."""
    parts = [s.encode("utf-8", "surrogatepass") for s in values]
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def decode_text(data: Any) -> np.ndarray:
    """KServe BYTES -> ``str [N]`` (object)."""
    view = memoryview(data).cast("B")
    out, at = [], 0
    while at < len(view):
        (n,) = struct.unpack_from("<I", view, at)
        out.append(bytes(view[at + 4 : at + 4 + n]).decode("utf-8", "surrogatepass"))
        at += 4 + n
    return np.array(out, dtype=object)


def _buffer(frame: Any) -> Any:
    """A received frame's memory (``zmq.Frame``) or the bytes themselves."""
    return frame.buffer if hasattr(frame, "buffer") else frame
