"""Row-wise quantization of vectors to INT8 and FP8 (e4m3) codes.

Each row ``x[i]`` is stored as ``codes[i] * scales[i]``: INT8 is symmetric (absmax / 127), FP8 is
``float8_e4m3fn`` scaled so that the row's absmax lands on 448, the format's largest finite value.
The index stores residuals to the list centroid, whose small magnitudes make both codes precise.

Shapes: ``x [N, D] float32`` -> ``codes [N, D] int8 | float8_e4m3fn``, ``scales [N] float32``.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
CODE_KINDS = ("int8", "fp8")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, D]`` -> ``(codes [N, D] int8, scales [N] float32)``; an all-zero row gets scale 0."""
    assert x.dim() == 2, f"x must be [N, D], got {tuple(x.shape)}"
    amax = x.abs().amax(dim=1).float()
    scales = amax / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(x.float() / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, D]`` -> ``(codes [N, D] float8_e4m3fn, scales [N] float32)``."""
    assert x.dim() == 2, f"x must be [N, D], got {tuple(x.shape)}"
    amax = x.abs().amax(dim=1).float()
    scales = amax / FP8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (x.float() / safe[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch on ``kind`` in :data:`CODE_KINDS`."""
    if kind == "int8":
        return quantize_int8(x)
    if kind == "fp8":
        return quantize_fp8(x)
    raise ValueError(f"codes must be one of {CODE_KINDS}, got {kind!r}")


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes [N, D]``, ``scales [N]`` -> ``[N, D] float32``."""
    return codes.float() * scales[:, None]


def fp8_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """``[256] float32``: the value of every e4m3 bit pattern (NaN patterns decode to 0)."""
    lut = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.nan_to_num(lut, nan=0.0).to(device)
