"""Document sharding: the catalog split across shard servers, a router in front.

* ``shard_server``: one shard's part of the index, searched over gRPC (``recserve serve shard``);
* ``router``: the engine's runner for a router: the tower once, scatter to every shard with one
  deadline, exact merge, partial answers naming missing shards;
* ``wire``: tensors <-> raw little-endian bytes of ``serving/protos/shard.proto``.
"""
