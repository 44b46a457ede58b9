"""Infrastructure every layer may use, and that imports none of them: gRPC helpers, security,
atomic files, the C++ extension builder, process launching and the ready announcement.

Layers import one way: ``recserve -> serving -> retrieval -> sharded_tables -> common``
(checked by ``make lint``; see ``[tool.importlinter]`` in ``pyproject.toml``).
"""

from importlib import metadata

try:
    __version__ = metadata.version("recserve")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"
