"""The model repository in Triton's layout: ``<root>/<model>/config.pbtxt`` + numbered versions.

- :mod:`serving.repository.config`: ``config.pbtxt`` as Triton's ``ModelConfig`` protobuf.
- :mod:`serving.repository.manifest`: a version's ``manifest.json`` (sizes, SHA-256) and its check.
- :mod:`serving.repository.repository`: :class:`ModelRepository` (publish atomically, retain, load).
- :mod:`serving.repository.model_folder`: version numbers, a version's own config, lock, leftovers.
- :mod:`serving.repository.triton_python_model`: the Triton Python backend copied into each version.
- :mod:`serving.repository.watcher`: :class:`VersionWatcher`, the newest loadable version as it
  appears (the model host's and the shard servers' poll loop).
- :mod:`serving.repository.publish_trained`: ``[publish]``'s policy for a trained model (imports
  the training config: not loaded by this package).

This package is the code; the repository it writes is any folder you give it (see README.md).
"""

from serving.repository.config import make_config, read_config, write_config
from serving.repository.manifest import CorruptVersionError, verify, write_manifest
from serving.repository.repository import LoadedModel, ModelRepository

__all__ = [
    "CorruptVersionError",
    "LoadedModel",
    "ModelRepository",
    "make_config",
    "read_config",
    "verify",
    "write_config",
    "write_manifest",
]
