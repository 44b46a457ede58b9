"""recserve: recommendation retrieval as one PyTorch model. The CLI lives in ``recserve.cli``."""

__version__ = "0.1.0"
