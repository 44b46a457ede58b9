"""Wire schemas of the serving processes (``make proto`` regenerates the ``*_pb2*.py``):
``recommend.proto`` (Recommend), ``shard.proto`` (router <-> shard server), ``admin.proto``
(live updates)."""
