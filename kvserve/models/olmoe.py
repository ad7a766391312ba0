"""OLMoE: Llama layers with routed experts (kvserve.models.moe; softmax top-k, raw weights
unless norm_topk_prob) whose attention RMS-normalizes the whole q and k projections (q_norm over
heads * head_dim, k_norm over kv_heads * head_dim, one norm across heads) before RoPE. OLMo-2 norms
the same way but multiplies by the weight before rounding to the activations' dtype; OLMoE
rounds first (Llama's RMSNorm), so its attention is its own."""

from __future__ import annotations

import torch

from kvserve.attention.layer import ForwardContext
from kvserve.config import ModelConfig
from kvserve.models.llama import LlamaAttention, RMSNorm, RotaryEmbedding
from kvserve.models.moe import MoeDecoderLayer, MoeForCausalLM, MoeModel


class OlmoeAttention(LlamaAttention):
    """Llama's attention with q and k RMS-normalized across all their heads before rotation."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]  # q, k, v in this order: a fused q|k|v product is made once and shared
        q = self.q_norm.forward(self.q_proj(x).contiguous())  # [T, heads * head_dim]
        k = self.k_norm.forward(self.k_proj(x).contiguous())
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q = rope(q.view(T, self.num_heads, self.head_dim), positions)
        k = rope(k.view(T, self.num_kv_heads, self.head_dim), positions)
        out = self.attn(q, k, v, ctx)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class OlmoeDecoderLayer(MoeDecoderLayer):
    attention_class = OlmoeAttention


class OlmoeModel(MoeModel):
    layer_class = OlmoeDecoderLayer


class OlmoeForCausalLM(MoeForCausalLM):
    model_class = OlmoeModel
