"""KServe v2 over HTTP (Starlette, run by uvicorn on ``--http-port``): ``make_app(state)``.

===============================================  ============================================
route                                            answer
===============================================  ============================================
``GET /v2/health/live``                          200 while the process is up
``GET /v2/health/ready``                         200 ready, 503 not (draining, nothing loaded)
``GET /v2``                                      server metadata
``GET /v2/models/{name}[/versions/{v}]``         model metadata
``GET /v2/models/{name}[/versions/{v}]/ready``   200 ready, 404 unknown, 503 not ready
``GET /v2/models/{name}[/versions/{v}]/config``  the loaded version's ``config.pbtxt`` as JSON
``POST /v2/models/{name}[/versions/{v}]/infer``  inference
===============================================  ============================================

Inference takes JSON tensors (``"data"``) and Triton's binary-data extension, which
``tritonclient.http`` uses by default: the JSON header is the first
``Inference-Header-Content-Length`` bytes of the body, and each input with a
``parameters.binary_data_size`` takes that many bytes, in input order, from what follows.
Outputs come back as binary when the request asks (``binary_data_output`` for all, or an
output's ``binary_data``), with the response header of the same name; otherwise as JSON
(where a padded score is ``-Infinity``, which Python's and tritonclient's parsers read).
A body may be gzip or deflate compressed (``Content-Encoding``); the limit applies to both
the compressed and the decompressed size.

Errors are ``{"error": "<message>"}``: 400 bad input (the message names the input or field),
404 unknown model or version (or route), 413 body over ``max_body_bytes``, 503 queue full or
draining (Triton answers a full queue with 503 too; it is the server's capacity, not the
caller's rate, so not 429), 504 deadline (Triton's ``timeout`` parameter, µs) passed, 408 a
body that did not arrive within ``limits.http_body_timeout_s`` (and its connection is closed:
the rest of that body may never come). The head before it is bounded by the connection
(``serving/frontends/http_conn.py``: 408 past ``limits.http_head_timeout_s``, 400 for bytes no
request line holds, 503 past ``limits.max_http_connections``). Every error message goes through
``serving.types.error_message`` (cut to a bounded length, whatever client text it quotes).

Request size limits come from ``state.limits`` (``[limits]``, ``serving/limits.py``), read at
each call. Log lines quote client text through ``common.logs.safe`` and are rate-limited; only
an unexpected error (our bug) logs a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.logs import limit_rate, safe
from serving.engine.state import ServingState
from serving.frontends import kserve
from serving.frontends.kserve import WireTensor
from serving.limits import DEFAULT_MAX_HTTP_BODY_BYTES
from serving.types import (
    DeadlineExceededError,
    RecResult,
    RequestError,
    error_message,
    error_status,
)

log = limit_rate(logging.getLogger(__name__))

HEADER_LENGTH = "Inference-Header-Content-Length"
DEFAULT_MAX_BODY_BYTES = DEFAULT_MAX_HTTP_BODY_BYTES
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class BodyTooLargeError(ValueError):
    """The request body (or what it decompresses to) is over the limit: HTTP 413."""


class BodyTimeoutError(RequestError):
    """The request body did not arrive within ``limits.http_body_timeout_s``: HTTP 408."""


CLOSE = {"Connection": "close"}


def error_response(exc: BaseException, where: str = "") -> JSONResponse:
    """The JSON error answer of ``exc``; logs one line for a body that timed out or a client
    that went away, a traceback only for an unexpected error."""
    code, status, _ = error_status(exc)
    headers = None
    if isinstance(exc, BodyTooLargeError):  # the connection stays: the client may still be
        status = 413  # sending, and a reset would hide the 413 from it
    elif isinstance(exc, BodyTimeoutError):
        status, headers = 408, CLOSE
        log.warning("http: %s: %s", safe(where), exc)
    elif isinstance(exc, ClientDisconnect):  # nobody reads the answer: one line, no traceback
        status = 499
        log.info("http: %s: the client went away before its body was read", safe(where))
    elif code == "INTERNAL":
        log.error("HTTP request %s failed", safe(where), exc_info=exc)
    body = {"error": error_message(exc)}
    return JSONResponse(body, status_code=status, headers=headers)


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, decompressed (gzip / deflate), refused past ``limit`` bytes either way, or
    when it takes more than ``timeout_s`` seconds to arrive (:class:`BodyTimeoutError`)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise BodyTooLargeError(f"body: {length} bytes is over the limit of {limit}")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLargeError(f"body: over the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeoutError(
            f"body: not received within {timeout_s:g} s ({size} bytes arrived; "
            "limits.http_body_timeout_s)"
        ) from None
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding == "identity":
        return body
    if encoding not in _WBITS:
        raise RequestError(f"Content-Encoding: {encoding!r} is not supported (gzip, deflate)")
    inflate = zlib.decompressobj(_WBITS[encoding])
    try:
        out = inflate.decompress(body, limit + 1)
    except zlib.error as e:
        raise RequestError(f"Content-Encoding: body is not valid {encoding}: {e}") from None
    if len(out) > limit:
        raise BodyTooLargeError(f"body: decompresses to over the limit of {limit} bytes")
    return out


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """-> (the JSON header, the binary data after it)."""
    cut = len(body)
    if header_length is not None:
        # ASCII only: "²" passes isdigit() but int() refuses it, as it does past 4300 digits
        valid = header_length.isascii() and header_length.isdecimal() and len(header_length) < 20
        if not valid or int(header_length) > len(body):
            shown = header_length if len(header_length) <= 40 else header_length[:37] + "..."
            raise RequestError(
                f"{HEADER_LENGTH}: must be a byte count in [0, {len(body)}], got {shown!r}"
            )
        cut = int(header_length)
    try:
        header = json.loads(body[:cut])
    except (ValueError, RecursionError) as e:
        raise RequestError(f"body: not a valid JSON inference request: {e}") from None
    if not isinstance(header, dict):
        raise RequestError("body: the inference request must be a JSON object")
    return header, body[cut:]


def _params(obj: dict[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestError(f"{where}: parameters must be an object")
    return params


def json_tensors(header: dict[str, Any], binary: bytes) -> list[WireTensor]:
    """The ``inputs`` of a JSON request, binary ones cut from ``binary`` in order."""
    inputs = header.get("inputs")
    if not isinstance(inputs, list):
        raise RequestError("inputs: must be a list of tensors")
    out, pos = [], 0
    for i, t in enumerate(inputs):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise RequestError(f"inputs: entry {i} is not a tensor with a name")
        name = t["name"]
        datatype, shape = t.get("datatype"), t.get("shape")
        if not isinstance(datatype, str):
            raise RequestError(f"{name}: datatype must be a string")
        if not isinstance(shape, list):
            raise RequestError(f"{name}: shape must be a list")
        size = _params(t, name).get("binary_data_size")
        raw = None
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise RequestError(f"{name}: binary_data_size must be a byte count, got {size!r}")
            if "data" in t:
                raise RequestError(f"{name}: has both data and binary_data_size")
            if pos + size > len(binary):
                raise RequestError(
                    f"{name}: binary_data_size {size}, but {len(binary) - pos} binary bytes left"
                )
            raw, pos = binary[pos : pos + size], pos + size
        out.append(WireTensor(name, datatype, shape, raw, t.get("data")))
    if pos != len(binary):
        raise RequestError(f"inputs: {len(binary) - pos} binary bytes after the last input")
    return out


def json_outputs(
    header: dict[str, Any], params: dict[str, Any], spec: kserve.ModelSpec
) -> tuple[list[str], set[str]]:
    """-> (the outputs asked for, those to send as binary)."""
    default = params.get("binary_data_output", False)
    wanted = header.get("outputs") or []
    if not isinstance(wanted, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in wanted
    ):
        raise RequestError("outputs: must be a list of objects with a name")
    names = kserve.requested_outputs([o["name"] for o in wanted], spec)
    binary = set()
    for o in wanted or [{"name": n} for n in names]:
        p = _params(o, "outputs")
        if p.get("classification"):
            raise RequestError(f"outputs: {o['name']}: classification is not supported")
        if p.get("binary_data", default) is True:
            binary.add(o["name"])
    return names, binary


def render_json(
    header: dict[str, Any], results: list[RecResult], names: list[str], binary: set[str]
) -> Response:
    outputs, blobs = [], []
    for o in kserve.render(results, names):
        tensor: dict[str, Any] = {"name": o.name, "datatype": o.datatype, "shape": o.shape}
        if o.name in binary:
            blob = o.raw()
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = o.array.ravel().tolist()
        outputs.append(tensor)
    body: dict[str, Any] = {
        "model_name": results[0].model,
        "model_version": str(results[0].version),  # rows that straddle a hot swap: the first's
        "outputs": outputs,
    }
    if isinstance(header.get("id"), str):
        body["id"] = header["id"]
    if any(r.partial for r in results):
        missing = sorted({m for r in results for m in r.missing})
        body["parameters"] = {"partial": True, "missing": ",".join(missing)}
    text = json.dumps(body, separators=(",", ":")).encode()
    if not blobs:
        return Response(text, media_type="application/json")
    return Response(
        b"".join([text, *blobs]),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(text))},
    )


async def gather(futures: list[Future[RecResult]], deadline: float | None) -> list[RecResult]:
    """Every row's result, the first row's error, or :class:`DeadlineExceededError`."""
    wrapped = [asyncio.wrap_future(f) for f in futures]
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    done, pending = await asyncio.wait(
        wrapped, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION
    )
    for w in done:
        if not w.cancelled():
            w.exception()  # retrieved: asyncio logs exceptions nobody looked at
    for w in pending:
        w.cancel()  # cancels the row's future too: a queued row leaves the queue
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    if pending:
        raise DeadlineExceededError("deadline: passed before the answer was ready")
    return [f.result() for f in futures]


def make_app(state: ServingState, *, max_body_bytes: int | None = None) -> Starlette:
    """The ASGI app over ``state`` (see the module docstring for routes and codes);
    ``max_body_bytes`` overrides ``state.limits.max_http_body_bytes``."""

    def guarded(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:
                return error_response(e, f"{request.method} {request.url.path}")

        return endpoint

    def spec_of(request: Request) -> kserve.ModelSpec:
        p = request.path_params
        return kserve.resolve(state, p["name"], p.get("version", ""))

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": state.ready}, status_code=200 if state.ready else 503)

    async def server_metadata(request: Request) -> Response:
        return JSONResponse(
            {
                "name": kserve.SERVER_NAME,
                "version": kserve.server_version(),
                "extensions": list(kserve.EXTENSIONS),
            }
        )

    async def model_metadata(request: Request) -> Response:
        spec = spec_of(request)

        def meta(t: kserve.TensorSpec) -> dict[str, Any]:
            return {"name": t.name, "datatype": t.datatype, "shape": [-1, *t.dims]}

        return JSONResponse(
            {
                "name": spec.name,
                "versions": [str(spec.version)],
                "platform": spec.platform,
                "inputs": [meta(t) for t in spec.inputs],
                "outputs": [meta(t) for t in spec.outputs],
            }
        )

    async def model_ready(request: Request) -> Response:
        spec_of(request)
        return JSONResponse({"ready": state.ready}, status_code=200 if state.ready else 503)

    async def model_config(request: Request) -> Response:
        config = kserve.model_config(state, spec_of(request))
        return JSONResponse(json_format.MessageToDict(config, preserving_proto_field_name=True))

    async def infer(request: Request) -> Response:
        call = state.call()  # counted once, however many rows: answered or refused
        try:
            response, version = await answer(request)
        except asyncio.CancelledError as e:  # the connection went away
            call.failed(e, "cancelled")
            raise
        except Exception as e:
            call.failed(e, "too_large" if isinstance(e, BodyTooLargeError) else None)
            raise
        call.succeeded(version)
        return response

    async def answer(request: Request) -> tuple[Response, int]:
        limits = state.limits
        body_limit = max_body_bytes or limits.max_http_body_bytes
        body = await read_body(request, body_limit, limits.http_body_timeout_s)
        spec = spec_of(request)
        header, binary = split_body(body, request.headers.get(HEADER_LENGTH))
        params = _params(header, "parameters")
        names, binary_out = json_outputs(header, params, spec)
        deadline = kserve.deadline_from(params)
        target = kserve.recall_target_from(params)
        reqs = kserve.parse(json_tensors(header, binary), spec, deadline=deadline, target=target)
        results = await gather(kserve.submit_rows(state, reqs), deadline)
        return render_json(header, results, names, binary_out), results[0].version

    async def not_found(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = error_message(ValueError(f"{request.url.path}: {exc.detail}"))
        return JSONResponse({"error": message}, exc.status_code)

    model = "/v2/models/{name}"
    routes = [
        Route("/v2/health/live", guarded(live), methods=["GET"]),
        Route("/v2/health/ready", guarded(ready), methods=["GET"]),
        Route("/v2", guarded(server_metadata), methods=["GET"]),
    ]
    for base in (model, model + "/versions/{version}"):
        routes += [
            Route(base, guarded(model_metadata), methods=["GET"]),
            Route(base + "/ready", guarded(model_ready), methods=["GET"]),
            Route(base + "/config", guarded(model_config), methods=["GET"]),
            Route(base + "/infer", guarded(infer), methods=["POST"]),
        ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})
