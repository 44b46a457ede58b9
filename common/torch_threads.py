"""Intra-op threads for the threads a server starts.

``torch.set_num_threads(n)`` sets OpenMP's thread count for the thread that calls it only (an
OpenMP setting is per thread). A thread started later that runs an MKL or OpenMP op (a Linear
layer's matmul) starts a team of as many threads as the machine has cores, and the team's
workers spin between ops: a router's batch thread, even with ``--torch-threads 1``, kept a
second thread spinning in ``libgomp``, and a loop of small Linear layers in a new thread kept
cores busy that the same loop in the main thread left idle. So every thread that computes
takes the process's count when it starts: :func:`use_process_threads`, as a
``ThreadPoolExecutor`` ``initializer`` or a thread's first call.
"""

from __future__ import annotations


def use_process_threads() -> None:
    """Gives the calling thread the process's intra-op thread count (``torch.get_num_threads``,
    what ``torch.set_num_threads`` last set anywhere in the process)."""
    import torch

    torch.set_num_threads(torch.get_num_threads())
