"""Front ends: parse a wire format into ``serving.types.RecRequest``, call the engine, render.

* ``recommend_grpc``: ``recserve.serving.v1.Recommender`` + ``grpc.health.v1``;
* ``kserve`` (the KServe v2 / Triton protocol, transport-free), ``kserve_grpc``
  (``inference.GRPCInferenceService``) and ``kserve_http`` (``/v2/...`` over uvicorn), so
  ``tritonclient`` works unchanged; ``http_conn``: uvicorn's HTTP/1.1 connections with bounded
  heads (a head timeout, a cap on open connections).
"""
