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

import struct
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.engine.state import ServingState
from serving.frontends.kserve_parse import (
    NUMPY,
    WireTensor,
    deadline_from,
    decode,
    parse,
    recall_target_from,
)
from serving.frontends.kserve_spec import (
    EXTENSIONS,
    SERVER_NAME,
    ModelSpec,
    TensorSpec,
    loaded_config,
    model_config,
    model_spec,
    resolve,
    server_version,
)
from serving.raw_ids import raw_item_ids
from serving.types import DATATYPES, RecRequest, RecResult, RequestError

__all__ = [
    "EXTENSIONS",
    "NUMPY",
    "SERVER_NAME",
    "ModelSpec",
    "OutputTensor",
    "TensorSpec",
    "WireTensor",
    "cancel",
    "deadline_from",
    "decode",
    "loaded_config",
    "model_config",
    "model_spec",
    "parse",
    "recall_target_from",
    "render",
    "requested_outputs",
    "resolve",
    "server_version",
    "submit_rows",
]

_PAD: dict[str, float] = {"item_ids": -1, "scores": -np.inf}


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


# ---- running -----------------------------------------------------------------------------------
def submit_rows(state: ServingState, reqs: list[RecRequest]) -> list[Future[RecResult]]:
    """Queues every row, or none: when a row is refused, the ones queued leave the queue (the
    refusal names the row: ``state.submit_rows``)."""
    return state.submit_rows(reqs)


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
    (one, unless the call straddled a hot swap); rows an engine process rendered are copied."""
    out = np.empty(ids.shape, dtype=object)  # [B, K]
    local = []
    for b, r in enumerate(results):
        if r.raw_item_ids is None:
            local.append(b)
        else:  # rendered by an engine in another process: "" pads to the call's K
            out[b] = ""
            out[b, : len(r.raw_item_ids)] = r.raw_item_ids
    maps = {id(results[b].item_map): results[b].item_map for b in local}
    for item_map in maps.values():
        rows = [b for b in local if results[b].item_map is item_map]
        out[rows] = raw_item_ids(ids[rows], item_map)
    return out
