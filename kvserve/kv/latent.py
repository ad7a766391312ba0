"""Latent KV storage for multi-head latent attention (MLA: DeepSeek-V2/V3).

An MLA layer's keys and values all come from one compressed latent per token (kv_lora_rank
values, after kv_a_layernorm) and one rotary key shared by every head (qk_rope_head_dim). The
cache holds exactly those, nothing per head:

    block b, layer l:  kv [block_size, 1, kv_lora_rank + qk_rope_head_dim]
                           |<---- latent c_kv ---->|<- k_rope ->|

Attention over it is multi-query attention with one "head": the key of a token is the whole
row [c_kv | k_rope], its value the latent c_kv, the first kv_lora_rank columns of the same row
(the model folds the per-head up-projections into the query and the output; see
kvserve.models.deepseek). So `write` takes k = the row [T, 1, latent_dim] and v = its latent
part, and stores k only; `gather` returns the rows as keys and a view of their latent part as
values. The blocks are paged through the same block tables as every storage and copied,
swapped and forked row by row (BlockTensorStorage).

    LatentKVStorage       kv in the cache dtype
    QuantLatentKVStorage  kv as int8 or fp8 codes [bs, 1, latent_dim] and a fp32 scale per
                          token for the latent and one for the rotary key [bs, 2]
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from kvserve.kv import quant
from kvserve.kv.storage import BlockTensorStorage, _gather


class LatentKVStorage(BlockTensorStorage):
    kind = "latent"

    def __init__(self, layer_to_tensor: Sequence[int], num_blocks: int, block_size: int, kv_lora_rank: int,
                 rope_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (block_size, 1, kv_lora_rank + rope_dim)
        super().__init__(layer_to_tensor, num_blocks, block_size, {"kv": (shape, dtype)}, device)
        self.kv_lora_rank, self.rope_dim, self.dtype = kv_lora_rank, rope_dim, dtype

    def reads_back_as(self) -> Optional[torch.dtype]:
        return self.dtype  # rows written as .to(dtype); values are the rows' latent part

    def decode_operands(self, layer: int) -> tuple[Any, ...]:
        """The rows and the latent's width (the CPU kernel's mla_decode)."""
        return self.layer_tensors(layer)["kv"], self.kv_lora_rank

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: Any) -> None:
        """k [T, 1, latent_dim] the rows; v (their latent part) is not stored twice."""
        self._check_row(k)
        self.layer_tensors(layer)["kv"].view(-1, 1, k.shape[-1]).index_put_((plan,), k.to(self.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [..., L, 1, latent_dim] and values [..., L, 1, kv_lora_rank] (a view of the keys)."""
        rows = _gather(self.layer_tensors(layer)["kv"], block_tables, num_slots)
        return rows, rows[..., :self.kv_lora_rank]

    def _check_row(self, k: torch.Tensor) -> None:
        width = self.kv_lora_rank + self.rope_dim
        if k.dim() != 3 or k.shape[1] != 1 or k.shape[2] != width:
            raise ValueError(f"a latent cache row is [T, 1, {width}] (kv_lora_rank {self.kv_lora_rank} + "
                             f"rope {self.rope_dim}), got {list(k.shape)}")


class QuantLatentKVStorage(LatentKVStorage):
    """int8 (codes q, x ≈ q · s, s = amax / 127) or fp8 (x ≈ fp8(x / s) · s, s = amax / the
    format's largest value) latents, scaled per token separately for the latent and the rotary
    key (their magnitudes differ: the latent is RMS-normalized, the rotary key is not)."""

    def __init__(self, layer_to_tensor: Sequence[int], num_blocks: int, block_size: int, kv_lora_rank: int,
                 rope_dim: int, fmt: str, device: torch.device | str) -> None:
        shape = (block_size, 1, kv_lora_rank + rope_dim)
        code = torch.int8 if fmt == "int8" else torch.uint8
        BlockTensorStorage.__init__(self, layer_to_tensor, num_blocks, block_size,
                                    {"kv": (shape, code), "scale": ((block_size, 2), torch.float32)}, device)
        self.kv_lora_rank, self.rope_dim, self.dtype = kv_lora_rank, rope_dim, torch.float32
        self.kind, self.format = ("latent_int8" if fmt == "int8" else "latent_fp8"), fmt
        self.table = None if fmt == "int8" else quant.fp8_table(fmt).to(self.device)  # the kernel's code values

    def reads_back_as(self) -> Optional[torch.dtype]:
        return None  # quantized rows

    def decode_operands(self, layer: int) -> tuple[Any, ...]:
        """Codes, scales and the latent's width (mla_decode_int8), and the fp8 code values (mla_decode_fp8)."""
        t = self.layer_tensors(layer)
        return (t["kv"], t["scale"], self.kv_lora_rank) + (() if self.table is None else (self.table,))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: Any) -> None:
        self._check_row(k)
        parts = k[:, 0].float().split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [T, r], [T, rope]
        codes, scales = zip(*(self._quantize(x) for x in parts))
        t = self.layer_tensors(layer)
        t["kv"].view(-1, 1, k.shape[-1]).index_put_((plan,), torch.cat(codes, -1).unsqueeze(1))
        t["scale"].view(-1, 2).index_put_((plan,), torch.stack(scales, -1))

    def gather(self, layer: int, block_tables: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.layer_tensors(layer)
        codes = _gather(t["kv"], block_tables, num_slots)[..., 0, :]  # [..., L, latent_dim]
        scales = _gather(t["scale"], block_tables, num_slots)  # [..., L, 2]
        latent, rope = codes.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        rows = torch.cat([self._dequantize(latent, scales[..., 0]), self._dequantize(rope, scales[..., 1])], -1)
        rows = rows.unsqueeze(-2)
        return rows, rows[..., :self.kv_lora_rank]

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] fp32 -> (codes [T, d], scale [T])."""
        if self.format == "int8":
            return quant.quantize_int8(x)
        limit = torch.finfo(quant.FP8_DTYPES[self.format]).max
        scale = (x.abs().amax(-1) / limit).clamp_min(quant.TINY)
        return quant.quantize_fp8(x, scale, self.format), scale

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.format == "int8":
            return quant.dequantize_int8(codes, scale)
        return quant.dequantize_fp8(codes, scale, self.format)


def make_latent_storage(kind: str, name: str, layer_to_tensor: Sequence[int], num_blocks: int, block_size: int,
                        kv_lora_rank: int, rope_dim: int, device: torch.device | str) -> LatentKVStorage:
    """The latent storage of a format (kvserve.kv.formats): dense keeps dtype `name`; int8 and
    fp8 quantize; int4 is not offered for latents."""
    args = (layer_to_tensor, num_blocks, block_size, kv_lora_rank, rope_dim)
    if kind == "dense":
        return LatentKVStorage(*args, getattr(torch, name), device)
    if kind in ("int8", "fp8"):
        return QuantLatentKVStorage(*args, name, device)
    raise ValueError(f"no latent (MLA) storage for kv cache format {name!r}; choose int8, fp8_e4m3 or a float dtype")
