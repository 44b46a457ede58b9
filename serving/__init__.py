"""Serving: the model behind gRPC ``Recommend``, KServe v2 (gRPC and HTTP) and a router.

Layers, each importing only those below it (checked by ``make lint``)::

    app/         the process: config, wiring, process groups, the ready line
    frontends/   Recommend gRPC, KServe v2 gRPC and HTTP: parse -> engine -> render
    sharding/    router and shard server (document shards), their wire format
    live/        live updates: messages, update log, LiveUpdates, the admin service
    repository/  the Triton-layout model repository (files, not models)
    engine/      batcher, model host (hot reload), runner, service state, metrics
    types.py     request/result types, errors and their status codes
    protos/      wire schemas

A request: front end parses -> ``types.RecRequest`` -> ``engine.state.submit`` -> batcher ->
``host.current()`` -> ``runner.run`` (one forward) -> ``types.RecResult`` -> front end renders.
"""
