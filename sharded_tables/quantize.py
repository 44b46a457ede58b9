"""Float rows <-> packed rows in fbgemm's TBE layout (see :mod:`sharded_tables.specs`).

``pack_rows(w [N, D] float, dtype) -> uint8 [N, row_bytes(D, dtype)]`` and
``unpack_rows(packed, dtype, D) -> float32 [N, D]`` are exact inverses up to the dtype's rounding:

* int8 / int4: asymmetric row-wise, ``scale = (max - min) / (2^bits - 1)`` and ``bias = min``,
  both stored as fp16 (what the kernel reads), codes rounded against the fp16 values; the error
  of one element is at most ``scale / 2`` plus fp16 rounding of ``bias``.
* fp8: e4m3 with exponent bias 7, values clipped to +-448 (fbgemm decodes the code torch reserves
  for NaN as 480; clipping means we never write it).
* fp16 / fp32: plain casts.

Pure torch, so the same helpers run on CPU and CUDA and need no fbgemm build.
"""

from __future__ import annotations

import torch

from sharded_tables.specs import SCALE_BIAS_BYTES, DType, row_bytes

FP8_MAX = 448.0
FP16_MAX = 65504.0


def _split_scale_bias(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``packed [N, 4 + C]`` -> (scale [N, 1] f32, bias [N, 1] f32, codes [N, C] uint8)."""
    sb = torch.empty(packed.shape[0], SCALE_BIAS_BYTES, dtype=torch.uint8, device=packed.device)
    sb = sb.copy_(packed[:, :SCALE_BIAS_BYTES]).view(torch.float16).float()  # [N, 2], aligned
    return sb[:, :1], sb[:, 1:2], packed[:, SCALE_BIAS_BYTES:]


def _int_codes(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise asymmetric quantization -> (codes [N, D] uint8, scale_bias [N, 4] uint8)."""
    levels = (1 << bits) - 1
    lo = w.amin(dim=1, keepdim=True)
    hi = w.amax(dim=1, keepdim=True)
    scale = ((hi - lo) / levels).to(torch.float16)
    bias = lo.to(torch.float16)
    # Codes are rounded against the fp16 values the kernel will read; a constant row gets
    # scale 0 and is stored exactly in the bias.
    s, b = scale.float(), bias.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((w - b) / safe).clamp_(0, levels).to(torch.uint8)
    sb = torch.cat([scale, bias], dim=1).contiguous().view(torch.uint8)  # [N, 4]
    return q, sb


def pack_rows(w: torch.Tensor, dtype: DType) -> torch.Tensor:
    """Float rows ``[N, D]`` -> packed rows ``uint8 [N, row_bytes(D, dtype)]`` (same device)."""
    dtype = DType(dtype)
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"expected float rows [N, D], got {w.dtype} {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("rows contain NaN or infinity")
    n, d = w.shape
    row_bytes(d, dtype)  # validates D for the dtype
    w = w.float()
    if dtype in (DType.FP16, DType.INT8, DType.INT4) and w.numel() and w.abs().max() > FP16_MAX:
        raise ValueError(f"{dtype.value} rows hold values up to {FP16_MAX}; got {w.abs().max()}")
    if dtype is DType.FP32:
        return w.contiguous().view(torch.uint8).reshape(n, 4 * d)
    if dtype is DType.FP16:
        return w.to(torch.float16).contiguous().view(torch.uint8).reshape(n, 2 * d)
    if dtype is DType.FP8:
        e4m3 = w.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return e4m3.view(torch.uint8).reshape(n, d)
    if dtype is DType.INT8:
        q, sb = _int_codes(w, 8)
        return torch.cat([sb, q], dim=1)
    q, sb = _int_codes(w, 4)  # two codes a byte, element 2i in the low nibble (fbgemm's order)
    q = q.view(n, d // 2, 2)
    return torch.cat([sb, q[:, :, 0] | (q[:, :, 1] << 4)], dim=1)


def unpack_rows(packed: torch.Tensor, dtype: DType, dim: int) -> torch.Tensor:
    """Packed rows ``uint8 [N, row_bytes(dim, dtype)]`` -> float32 ``[N, dim]``."""
    dtype = DType(dtype)
    rb = row_bytes(dim, dtype)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != rb:
        raise ValueError(
            f"expected uint8 [N, {rb}] packed {dtype.value} rows, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    n = packed.shape[0]
    if dtype is DType.FP32:
        return packed.contiguous().view(torch.float32).reshape(n, dim).clone()
    if dtype is DType.FP16:
        return packed.contiguous().view(torch.float16).reshape(n, dim).float()
    if dtype is DType.FP8:
        return packed.contiguous().view(torch.float8_e4m3fn).float()
    scale, bias, codes = _split_scale_bias(packed)
    if dtype is DType.INT4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=2).reshape(n, dim)
    return codes.float() * scale + bias


def quantization_bound(w: torch.Tensor, dtype: DType) -> torch.Tensor:
    """Largest error ``|unpack(pack(w)) - w|`` the format allows, per row ``[N]``.

    Used by tests and by callers that check a plan's accuracy: int rows lose half a step
    (plus fp16 rounding of scale and bias, relative 2^-11 each, times the code range); fp8 and
    fp16 lose a relative half-ulp (2^-4 and 2^-11) plus the fp8 clip.
    """
    dtype = DType(dtype)
    w = w.float()
    mag = w.abs().amax(dim=1)
    if dtype is DType.FP32:
        return torch.zeros_like(mag)
    if dtype is DType.FP16:
        return mag * 2.0**-11 + 6e-8
    if dtype is DType.FP8:
        over = (mag - FP8_MAX).clamp(min=0)
        return mag.clamp(max=FP8_MAX) * 2.0**-4 + 2.0**-10 + over
    levels = 255 if dtype is DType.INT8 else 15
    rng = w.amax(dim=1) - w.amin(dim=1)
    fp16_rel = 2.0**-11
    # a range below fp16's smallest step stores scale 0 and loses up to the whole range
    return rng / levels / 2 + (rng + mag) * fp16_rel * 2 + levels * 6e-8
