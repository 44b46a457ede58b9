"""recserve: recommendation retrieval as one PyTorch model. The CLI lives in ``recserve.cli``."""

from common import __version__

__all__ = ["__version__"]
