"""The remote tier: embedding servers holding packed rows in DRAM, read over gRPC.

* :mod:`~sharded_tables.remote.server_files`: one server's folder on disk (manifest + packed rows,
  keyed tables' put logs), written atomically.
* :mod:`~sharded_tables.remote.server`: ``EmbeddingServer`` / ``serve`` (``recserve serve embeddings``).
* :mod:`~sharded_tables.remote.client`: ``RemoteTables``, the batched, de-duplicated client.
* ``embedding.proto``: the wire schema (``make proto`` regenerates ``embedding_pb2*.py``).
"""

from sharded_tables.remote.client import RemoteLookupError, RemoteTable, RemoteTables, route
from sharded_tables.remote.server import EmbeddingServer, MemoryBudgetError, parse_size, serve
from sharded_tables.remote.server_files import ServerTable, read_server_folder, write_server_folder

__all__ = [
    "EmbeddingServer",
    "MemoryBudgetError",
    "RemoteLookupError",
    "RemoteTable",
    "RemoteTables",
    "ServerTable",
    "parse_size",
    "read_server_folder",
    "route",
    "serve",
    "write_server_folder",
]
