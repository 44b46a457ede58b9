"""The serving process: front ends -> dynamic batcher -> model runner, with hot reload.

``recserve serve --model-repo DIR`` loads the latest version of a model from a Triton-style
repository (:mod:`serving.repository`; the folder itself, e.g. `model_repo/`), serves the gRPC ``Recommend`` endpoint with ``grpc.health.v1``
(and the KServe v2 protocol where built), batches requests dynamically, swaps in new versions
between batches, exports Prometheus metrics, and drains on SIGTERM.

Flow: ``grpc_server`` / ``kserve*`` / ``http_app`` parse -> :class:`requests.RecRequest` ->
``state.submit`` -> ``batching.DynamicBatcher`` -> ``host.ModelHost.current()`` ->
``runner.ModelRunner.run`` -> :class:`requests.RecResult`.
"""
