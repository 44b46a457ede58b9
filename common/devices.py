"""Where a server or job runs its model: ``cpu``, ``cuda`` or ``cuda:N``, checked at start.

Every ``--device`` (``recserve serve model | router | shard``, ``recserve score``) goes through
:func:`check_device`, so asking for a GPU this process cannot use fails before anything loads,
naming the field and what torch sees, instead of at the first tensor moved there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # configs import this module: `--help` must not load torch
    import torch

DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"
"""What a device field accepts (pydantic ``pattern``)."""


def check_device(name: str, field: str = "device") -> torch.device:
    """``name`` -> the ``torch.device``; ``ValueError`` naming ``field`` when it is CUDA and
    torch has no CUDA device with that index."""
    import torch

    dev = torch.device(name)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "no CUDA device or driver found"
        raise ValueError(
            f"{field}: {name} asked for, but torch {torch.__version__} sees no GPU ({why}); "
            "use --device cpu, or install the GPU image (deploy/README.md)"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{field}: {name} asked for, but torch sees {count} CUDA device(s)")
    return dev
