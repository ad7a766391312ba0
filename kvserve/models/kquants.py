"""GGUF's K-quants and 5-bit types in torch: each block decoded to small integers q and, per
group of 16 or 32 weights, a scale and an offset, with

    w = scale[g] * q + offset[g]      scale = d * sc;  offset = -(dmin * m), m (Q5_1) or none

each product and sum rounded in fp32 as the `gguf` package (and llama.cpp's dequantize_row_*)
rounds them, so the weights are bit-equal to `gguf.quants.dequantize`. The block layouts, bytes
in GGUF's order (d, dmin: fp16):

    Q5_0    d | qh (32 fifth bits) | qs[16] (low nibbles: weights 0..15, high: 16..31)   q - 16
    Q5_1    d | m | qh | qs[16]                                                           q
    IQ4_NL  d | qs[16]: nibbles index a table of 16 values in -127..113
    Q2_K    scales[16] (sc: low nibble, m: high) | qs[64] (2 bits) | d | dmin            16 x 16
    Q3_K    hmask[32] | qs[64] (2 bits) | scales[12] (16 6-bit, minus 32) | d            16 x 16
    Q4_K    d | dmin | scales[12] (8 6-bit sc and 8 6-bit m) | qs[128]                   8 x 32
    Q5_K    d | dmin | scales[12] | qh[32] | qs[128]                                     8 x 32
    Q6_K    ql[128] | qh[64] (2 bits) | scales[16] int8 | d; q - 32                      16 x 16

kernels/csrc/linear_kquant.cpp decodes the same way; its comments say where each bit goes.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

# (q [..., values] int, scale [..., groups] fp32, offset [..., groups] fp32 or None) of blocks [..., bytes]
Decoded = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _half(b: torch.Tensor) -> torch.Tensor:
    """fp16 values from their two little-endian bytes [..., 2], as fp32 [...]."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16 c] bytes -> [..., 32 c]: each run of 16 bytes' low nibbles, then its high ones."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, 16)
    return torch.cat([q & 15, q >> 4], dim=-2).flatten(-3)


def _bit_planes(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """[..., L] -> [..., len(shifts), L]: (b >> s) & mask for each shift."""
    s = torch.tensor(shifts, dtype=torch.int32).reshape(-1, 1)
    return (b.unsqueeze(-2) >> s) & mask


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes of a little-endian u32 -> its 32 bits [..., 32], bit j at j."""
    return _bit_planes(qh, list(range(8)), 1).transpose(-1, -2).flatten(-2)


def _decode_q5_0(b: torch.Tensor) -> Decoded:
    q = _nibbles(b[..., 6:22]) | (_fifth_bits(b[..., 2:6]) << 4)
    return q - 16, _half(b[..., 0:2]).unsqueeze(-1), None


def _decode_q5_1(b: torch.Tensor) -> Decoded:
    q = _nibbles(b[..., 8:24]) | (_fifth_bits(b[..., 4:8]) << 4)
    return q, _half(b[..., 0:2]).unsqueeze(-1), _half(b[..., 2:4]).unsqueeze(-1)


def _decode_iq4_nl(b: torch.Tensor) -> Decoded:
    table = torch.tensor(IQ4_NL_VALUES, dtype=torch.int32)
    return table[_nibbles(b[..., 2:18]).long()], _half(b[..., 0:2]).unsqueeze(-1), None


def _decode_q2_k(b: torch.Tensor) -> Decoded:
    d, dmin = _half(b[..., 80:82]).unsqueeze(-1), _half(b[..., 82:84]).unsqueeze(-1)
    sc = b[..., 0:16]
    # weight 128h + 32t + l: bits 2t, 2t+1 of qs[32h + l]
    q = _bit_planes(b[..., 16:80].reshape(*b.shape[:-1], 2, 32), [0, 2, 4, 6], 3).flatten(-3)
    return q, d * (sc & 15).float(), -(dmin * (sc >> 4).float())


def _decode_q3_k(b: torch.Tensor) -> Decoded:
    s, d = b[..., 96:108], _half(b[..., 108:110]).unsqueeze(-1)
    low = torch.cat([s[..., 0:8] & 15, s[..., 0:8] >> 4], dim=-1)
    high = _bit_planes(s[..., 8:12], [0, 2, 4, 6], 3).flatten(-2)
    sc = (low | (high << 4)) - 32
    # weight 128h + 32t + l: bits 2t, 2t+1 of qs[32h + l], less 4 where bit 4h + t of hmask[l] is clear
    q = _bit_planes(b[..., 32:96].reshape(*b.shape[:-1], 2, 32), [0, 2, 4, 6], 3).flatten(-3)
    hbit = _bit_planes(b[..., 0:32], list(range(8)), 1).flatten(-2)
    return q - 4 * (1 - hbit), d * sc.float(), None


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> 8 6-bit scales and 8 6-bit minimums (llama.cpp's get_scale_min_k4)."""
    a, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([a & 63, (md & 15) | ((a >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc, mn


def _k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, dmin = _half(b[..., 0:2]).unsqueeze(-1), _half(b[..., 2:4]).unsqueeze(-1)
    sc, mn = _scale_min_k4(b[..., 4:16])
    return d * sc.float(), -(dmin * mn.float())


def _k4_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs[128] -> 256: weights 64c + l and 64c + 32 + l are the low and high nibble of qs[32c + l]."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([q & 15, q >> 4], dim=-2).flatten(-3)


def _decode_q4_k(b: torch.Tensor) -> Decoded:
    scale, offset = _k4_scales(b)
    return _k4_nibbles(b[..., 16:144]), scale, offset


def _decode_q5_k(b: torch.Tensor) -> Decoded:
    scale, offset = _k4_scales(b)
    fifth = _bit_planes(b[..., 16:48], list(range(8)), 1).flatten(-2)  # weight 32g + l: bit g of qh[l]
    return _k4_nibbles(b[..., 48:176]) | (fifth << 4), scale, offset


def _decode_q6_k(b: torch.Tensor) -> Decoded:
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 2, 32)
    # weight 128h + 32t + l: nibble t // 2 of ql[64h + 32 (t % 2) + l], bits 2t, 2t+1 of qh[32h + l]
    low = torch.cat([ql & 15, ql >> 4], dim=-2)  # [..., 2, 4, 32]
    high = _bit_planes(b[..., 128:192].reshape(*lead, 2, 32), [0, 2, 4, 6], 3)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    return ((low | (high << 4)) - 32).flatten(-3), _half(b[..., 208:210]).unsqueeze(-1) * sc, None


DECODERS: dict[str, Callable[[torch.Tensor], Decoded]] = {
    "q5_0": _decode_q5_0, "q5_1": _decode_q5_1, "iq4_nl": _decode_iq4_nl, "q2_k": _decode_q2_k,
    "q3_k": _decode_q3_k, "q4_k": _decode_q4_k, "q5_k": _decode_q5_k, "q6_k": _decode_q6_k}


def dequantize(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """Blocks uint8 [..., block bytes] of type `name` -> fp32 [..., block values]."""
    q, scale, offset = DECODERS[name](blocks)
    group = q.shape[-1] // scale.shape[-1]
    w = scale.repeat_interleave(group, dim=-1) * q.float()
    return w if offset is None else w + offset.repeat_interleave(group, dim=-1)


def quantize(w: torch.Tensor, name: str, ggml_type: int, block: int) -> torch.Tensor:
    """Float [N, K] -> packed rows uint8 [N, row bytes] by the gguf package's quantizer (it has
    Q5_0's and Q5_1's; the K-quants and IQ4_NL come packed, from GGUF files)."""
    import gguf
    import numpy as np
    qtype = gguf.GGMLQuantizationType(ggml_type)
    n, k = w.shape
    if k % block:
        raise ValueError(f"a {name} weight needs K divisible by {block}, got {k}")
    try:
        rows = gguf.quants.quantize(w.detach().float().numpy().astype(np.float32), qtype)
    except NotImplementedError as e:
        raise ValueError(f"no quantizer for {name} here: its weights come packed, from GGUF files ({e})") from None
    return torch.from_numpy(np.ascontiguousarray(rows)).reshape(n, -1)
