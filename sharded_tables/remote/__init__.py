"""The remote tier: embedding servers holding packed rows in DRAM, read over gRPC.

* :mod:`~sharded_tables.remote.server_files`: one server's folder on disk (manifest + packed rows,
  keyed tables' put logs), written atomically.
* :mod:`~sharded_tables.remote.server`: ``EmbeddingServer`` / ``serve`` (``recserve serve embeddings``).
* :mod:`~sharded_tables.remote.client`: ``RemoteTables``, the batched, de-duplicated client.
* :mod:`~sharded_tables.remote.routing`: ``RemoteTable``, which server holds which ids.
* :mod:`~sharded_tables.remote.config`: ``EmbeddingServerConfig`` (no torch: the CLI reads it).
* ``embedding.proto``: the wire schema (``make proto`` regenerates ``embedding_pb2*.py``).

Import the modules themselves: the package re-exports nothing, so reading the config loads no
torch.
"""
