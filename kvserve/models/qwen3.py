"""Qwen3 (dense): Llama's layers with q and k RMS-normalized per head before RoPE.

    q = rope(q_norm(q_proj(x)) per head)      q_norm, k_norm: RMSNorm [head_dim], one per layer
    k = rope(k_norm(k_proj(x)) per head)

`Qwen3Attention` is the attention of Qwen3's mixture-of-experts models too.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.layer import ForwardContext
from kvserve.config import ModelConfig
from kvserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm, \
    RotaryEmbedding


def head_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] normalized head by head: [T, heads, D]. The heads go to the norm as rows of
    one 2-D tensor, the shape its kernel takes."""
    T, heads, D = x.shape
    return norm(x.reshape(T * heads, D)).view(T, heads, D)  # type: ignore[no-any-return]


class Qwen3Attention(LlamaAttention):
    """LlamaAttention whose q and k heads are each normalized (q_norm, k_norm) before RoPE. Its
    fast form is its blocks' (the norms' and RoPE's kernels, the attention backend's)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.project(x)
        q = rope(head_norm(self.q_norm, q), positions)
        k = rope(head_norm(self.k_norm, k), positions)
        return self.attend(q, k, v, ctx)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def attention_for(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Qwen3Attention(config, layer_idx)


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
