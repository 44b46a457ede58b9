"""The serving engine, free of any wire protocol: requests in, results out.

``state.ServingState.submit`` (``runner.ModelRunner.admit``: the edge check -> an ``Admission``)
-> ``batching.DynamicBatcher`` (a pure ``BatchPolicy`` decides) -> ``host.ModelHost.current()``
(the version being served, hot reload) -> ``runner.ModelRunner.run`` (one
``RetrievalModel.forward`` per batch) -> one outcome per request; ``metrics`` counts it all.
Front ends (``serving/frontends``) and the router (``serving/sharding``) call this; it imports
neither, nor grpc or HTTP.
"""
