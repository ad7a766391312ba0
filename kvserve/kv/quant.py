"""Quantize and dequantize K/V as pure tensor functions (the storages and the tests call these;
the CPU kernel does the same arithmetic in registers).

    int8   x ≈ q · s            q in [-127, 127], s = amax|x| / 127 per token per head
    int4   x ≈ q · s + z        q in [0, 15], s = (max - min) / 15, z = min; keys per channel
                                over a block's tokens, values per token over its channels
    fp8    x ≈ fp8(x / s) · s   s fixed per layer and KV head; values beyond the format saturate

Every function takes and returns tensors shaped [..., head_dim] (int4 packs two values a byte:
channel c and channel c + head_dim / 2 share byte c, low nibble first, so 16 consecutive bytes
unpack to 16 consecutive channels of each half).
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TINY = 1e-8  # the smallest scale: an all-zero (or constant) group still divides safely


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hd] -> (q int8 [..., hd], scale fp32 [...])."""
    x = x.float()
    scale = (x.abs().amax(-1) / 127).clamp_min(TINY)
    q = torch.round(x / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


def quantize_int4(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., hd] -> (packed uint8 [..., hd / 2], scale fp16, zero fp16), the scale and zero
    taken over `dim` (-1: per token over its channels; -3 for [bs, kvh, hd]: per channel over
    the block's tokens) and shaped with that dim removed."""
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(TINY).half().float()  # the stored fp16 values are the ones used
    zero = lo.half().float()
    q = torch.round((x - zero) / scale).clamp_(0, 15).to(torch.uint8)
    half = x.shape[-1] // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed, scale.squeeze(dim).half(), zero.squeeze(dim).half()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., hd / 2] uint8 -> [..., hd] values 0..15 (channel c and c + hd/2 from byte c)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of quantize_int4 over the same `dim`."""
    return unpack_int4(packed).float() * scale.float().unsqueeze(dim) + zero.float().unsqueeze(dim)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., kvh, hd] with scale [kvh] -> uint8 codes of fp8(x / scale), saturated."""
    dtype = FP8_DTYPES[name]
    limit = torch.finfo(dtype).max
    y = (x.float() / scale.unsqueeze(-1)).clamp_(-limit, limit)
    return y.to(dtype).view(torch.uint8)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    return codes.view(FP8_DTYPES[name]).float() * scale.unsqueeze(-1)


def fp8_table(name: str) -> torch.Tensor:
    """The 256 values of the fp8 codes as fp32 (what the kernel looks a code up in)."""
    return torch.arange(256, dtype=torch.uint8).view(FP8_DTYPES[name]).float().nan_to_num(0.0)
