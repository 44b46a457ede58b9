"""Live in-place updates of a served model, between batches, logged so a restart replays them.

* ``messages``: wire messages <-> update batches; ``update_log``: the fsync'd, CRC-framed log;
* ``updates``: ``LiveUpdates`` applies and replays (no gRPC); ``admin``: the gRPC face.
"""
