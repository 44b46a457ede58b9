"""KServe v2 ``inference.GRPCInferenceService`` on the serving gRPC port.

Reuses tritonclient's generated ``service_pb2`` / ``service_pb2_grpc``, so field numbers are
the ones ``tritonclient.grpc`` speaks. Served: ServerLive, ServerReady, ModelReady,
ServerMetadata, ModelMetadata, ModelConfig (the loaded version's ``config.pbtxt``), ModelInfer;
the other methods answer UNIMPLEMENTED without logging (the generated base class raises, and
gRPC logs a traceback per call: a flood anyone can cause).

ModelInfer: inputs in ``raw_input_contents`` (what tritonclient sends) or typed ``contents``
-> :func:`serving.frontends.kserve.parse` -> one batcher request per row (rows of different calls share
batches) -> outputs in ``raw_output_contents`` (tritonclient reads only those). The call's
deadline and Triton's ``timeout`` parameter (µs) both bound the wait.

=======================  ==========================================================
status                   when
=======================  ==========================================================
``INVALID_ARGUMENT``     bad input (the message starts with the input's name); bytes that
                         are no valid request message (``request: ...``)
``NOT_FOUND``            unknown model or version
``RESOURCE_EXHAUSTED``   the batcher's queue is full (or the message is too large)
``DEADLINE_EXCEEDED``    the deadline passed before the answer
``UNAVAILABLE``          draining (SIGTERM) or no version loaded
=======================  ==========================================================
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from common.grpc_util import MalformedMessage, add_service
from common.logs import limit_rate
from serving.engine.state import ServingState
from serving.frontends import kserve
from serving.frontends.kserve import WireTensor
from serving.types import (
    ModelNotFoundError,
    RecResult,
    RequestError,
    error_message,
    error_status,
)

log = limit_rate(logging.getLogger(__name__))

SERVICE = "inference.GRPCInferenceService"

CONTENTS_FIELD = {
    "INT64": "int64_contents",
    "INT32": "int_contents",
    "FP32": "fp32_contents",
    "BYTES": "bytes_contents",
}
"""Where typed contents of each datatype go in ``InferTensorContents``."""


def wire_tensors(request: pb.ModelInferRequest) -> list[WireTensor]:
    """The inputs of a ``ModelInferRequest`` as :class:`WireTensor` s (contents unchecked)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise RequestError(
            f"raw_input_contents: {len(raw)} entries for {len(request.inputs)} inputs "
            "(give one per input, or none and typed contents)"
        )
    out = []
    for i, t in enumerate(request.inputs):
        values = None
        if t.HasField("contents"):
            used = [f.name for f, _ in t.contents.ListFields()]
            want = CONTENTS_FIELD.get(t.datatype)
            if any(f != want for f in used):
                raise RequestError(
                    f"{t.name}: {t.datatype} contents go in {want or 'no typed field'}, "
                    f"got {', '.join(used)}"
                )
            if want is not None:
                values = list(getattr(t.contents, want))
        out.append(WireTensor(t.name, t.datatype, list(t.shape), raw[i] if raw else None, values))
    return out


def parameters(params: Any) -> dict[str, Any]:
    """``map<string, InferParameter>`` -> plain values."""
    out = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(p, which)
    return out


def render_response(
    request: pb.ModelInferRequest, results: list[RecResult], names: list[str]
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(
        model_name=results[0].model,
        model_version=str(results[0].version),  # rows that straddle a hot swap: the first's
        id=request.id,
    )
    for o in kserve.render(results, names):
        response.outputs.add(name=o.name, datatype=o.datatype, shape=o.shape)
        response.raw_output_contents.append(o.raw())
    if any(r.partial for r in results):
        response.parameters["partial"].bool_param = True
        missing = sorted({m for r in results for m in r.missing})
        response.parameters["missing"].string_param = ",".join(missing)
    return response


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The KServe v2 methods over one :class:`~serving.engine.state.ServingState`."""

    def __init__(self, state: ServingState):
        self.state = state

    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.ready)

    def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.ServicerContext
    ) -> pb.ModelReadyResponse:
        try:
            kserve.resolve(self.state, request.name, request.version)
        except Exception:  # unknown, malformed or not loaded: not ready
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.state.ready)

    def ServerMetadata(
        self, request: Any, context: grpc.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=kserve.SERVER_NAME, version=kserve.server_version(), extensions=kserve.EXTENSIONS
        )

    def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.ServicerContext
    ) -> pb.ModelMetadataResponse:
        spec = self._resolve(request.name, request.version, context)

        def meta(t: kserve.TensorSpec) -> pb.ModelMetadataResponse.TensorMetadata:
            return pb.ModelMetadataResponse.TensorMetadata(
                name=t.name, datatype=t.datatype, shape=[-1, *t.dims]
            )

        return pb.ModelMetadataResponse(
            name=spec.name,
            versions=[str(spec.version)],
            platform=spec.platform,
            inputs=[meta(t) for t in spec.inputs],
            outputs=[meta(t) for t in spec.outputs],
        )

    def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.ServicerContext
    ) -> pb.ModelConfigResponse:
        spec = self._resolve(request.name, request.version, context)
        return pb.ModelConfigResponse(config=kserve.model_config(self.state, spec))

    def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.ServicerContext
    ) -> pb.ModelInferResponse:
        futures: list[Any] = []
        call = self.state.call()  # counted once, however many rows: answered or refused
        try:
            if isinstance(request, MalformedMessage):
                raise RequestError(request.message)
            spec = kserve.resolve(self.state, request.model_name, request.model_version)
            names = kserve.requested_outputs([o.name for o in request.outputs], spec)
            params = parameters(request.parameters)
            deadline = kserve.deadline_from(params, context.time_remaining())
            target = kserve.recall_target_from(params)
            reqs = kserve.parse(wire_tensors(request), spec, deadline=deadline, target=target)
            futures = kserve.submit_rows(self.state, reqs)
            context.add_callback(lambda: kserve.cancel(futures))  # the caller went away
            results = [self.state.wait(f, deadline) for f in futures]
        except Exception as e:
            kserve.cancel(futures)
            call.failed(e)
            code, _, _ = error_status(e)
            if code == "INTERNAL":
                log.exception("ModelInfer failed")
            error: Exception = e
        else:
            call.succeeded(results[0].version)
            return render_response(request, results, names)
        context.abort(grpc.StatusCode[code], error_message(error))
        raise AssertionError("unreachable: abort raises")

    def _resolve(self, name: str, version: str, context: grpc.ServicerContext) -> kserve.ModelSpec:
        try:
            return kserve.resolve(self.state, name, version)
        except (RequestError, ModelNotFoundError, RuntimeError) as e:
            error = e
        code, _, _ = error_status(error)
        context.abort(grpc.StatusCode[code], error_message(error))
        raise AssertionError("unreachable: abort raises")


def _unimplemented(name: str) -> Callable[[Any, Any, grpc.ServicerContext], Any]:
    def method(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name}: not implemented by recserve")

    return method


for _method in pb.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[-1]].methods:
    if _method.name not in vars(KServeServicer):
        setattr(KServeServicer, _method.name, _unimplemented(_method.name))


def add_kserve_servicer(server: grpc.Server, state: ServingState) -> None:
    """Adds ``inference.GRPCInferenceService`` to ``server`` (before it starts), every method of
    it (those not served answer UNIMPLEMENTED), with :func:`common.grpc_util.add_service`: bytes
    that are no valid message get INVALID_ARGUMENT, where the generated deserializer makes gRPC
    answer INTERNAL (``ModelInfer`` refuses them itself, so that the metrics count them)."""
    add_service(server, pb, SERVICE, KServeServicer(state), refuses_itself={"ModelInfer"})


add_servicer = add_kserve_servicer
"""The name every gRPC front end gives its ``add_servicer`` (``serving/app/frontends.py``)."""
