"""Row-wise quantization of vectors to INT8 and FP8 (e4m3) codes.

Each row ``x[i]`` is stored as ``codes[i] * scales[i]``: INT8 is symmetric (absmax / 127), FP8 is
``float8_e4m3fn`` scaled so that the row's absmax lands on 448, the format's largest finite value.
The index stores residuals to the list centroid, whose small magnitudes make both codes precise.

Shapes: ``x [N, D] float32`` -> ``codes [N, D] int8 | float8_e4m3fn``, ``scales [N] bfloat16``.

Scales are stored as bfloat16, 2 bytes an item instead of 4 (at 64 dimensions that is what keeps
the index within 10 % of faiss IVF-SQ8's bytes), with float32's range: any finite vector fits. A
scale is rounded *before* the row is quantized with it, so what is stored decodes exactly as the
codes were made, and the rounding costs no precision: the codes adapt to the stored scale (the
row's largest value lands within a quarter step of the largest code).
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
CODE_KINDS = ("int8", "fp8")


def stored_scales(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Row scales ``amax / top`` as stored: ``[N] bfloat16`` (round to nearest even)."""
    return (amax.float() / top).bfloat16()


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored rows: ``x [N, D]`` -> ``(codes [N, D] int8, scales [N] bfloat16)``; an all-zero
    row gets scale 0."""
    assert x.dim() == 2, f"x must be [N, D], got {tuple(x.shape)}"
    scales = stored_scales(x.abs().amax(dim=1), INT8_MAX)
    return _int8_codes(x, scales.float()), scales


def quantize_query_int8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries, as the scan kernels quantize them (never stored, so the scale stays a float):
    ``q [B, D]`` -> ``(codes [B, D] int8, scales [B] float32)``."""
    assert q.dim() == 2, f"q must be [B, D], got {tuple(q.shape)}"
    scales = q.abs().amax(dim=1).float() / INT8_MAX
    return _int8_codes(q, scales), scales


def _int8_codes(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``round(x / scale)`` per row (half to even), clamped to +-127; scale 0 keeps zeros."""
    return (
        torch.round(x.float() / _divisors(scales)[:, None])
        .clamp_(-INT8_MAX, INT8_MAX)
        .to(torch.int8)
    )


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, D]`` -> ``(codes [N, D] float8_e4m3fn, scales [N] bfloat16)``."""
    assert x.dim() == 2, f"x must be [N, D], got {tuple(x.shape)}"
    scales = stored_scales(x.abs().amax(dim=1), FP8_MAX)
    codes = (
        (x.float() / _divisors(scales.float())[:, None])
        .clamp_(-FP8_MAX, FP8_MAX)
        .to(torch.float8_e4m3fn)
    )
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
    return codes.float() * scales.float()[:, None]


def _divisors(scales: torch.Tensor) -> torch.Tensor:
    """``scales [N]`` float32 with 0 (an all-zero row) replaced by 1, to divide by."""
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def fp8_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """``[256] float32``: the value of every e4m3 bit pattern (NaN patterns decode to 0)."""
    lut = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.nan_to_num(lut, nan=0.0).to(device)
