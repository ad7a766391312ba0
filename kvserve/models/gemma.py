"""Gemma 2 and Gemma 3 (text) decoders over a flat token batch, as kvserve's Llama model but for
what these families do differently (names follow Hugging Face, so loading is a rename table):

    embeddings      scaled by sqrt(hidden_size)
    norms           RMSNorm times (1 + weight); one after attention and one before and after the
                    MLP besides the input norm; Gemma 3 also normalizes q and k per head
    MLP             GeGLU: down(gelu_tanh(gate(x)) * up(x))
    attention       scale query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps scores
                    (cap * tanh(s / cap)); sliding-window layers between full ones, Gemma 3's with
                    their own RoPE base
    logits          Gemma 2 soft-caps them too
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.layer import Attention, ForwardContext
from kvserve.config import ModelConfig
from kvserve.models.linear import Linear
from kvserve.models.llama import LlamaForCausalLM, RotaryEmbedding, make_embedding


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        if config.architecture == "gemma3":
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(layer_idx, config.attention_scale, config.attn_logit_softcapping)
        self.fused_qkv: Optional[nn.Module] = None  # packed q, k, v as one product; the parts read it

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(rope(q, positions), rope(k, positions), v, ctx)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused_gate_up: Optional[nn.Module] = None  # packed gate and up as one product; the parts read it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = GemmaAttention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, rope, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(LlamaForCausalLM):
    """Llama's frame (weights, lm_head, RoPE tables grown on demand) with Gemma's layers, scaled
    embeddings, a second RoPE for sliding layers and soft-capped logits."""

    model_class = GemmaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.local_rope: Optional[RotaryEmbedding] = None

    def init_rope(self, max_len: int) -> None:
        """Global layers: rope_theta (and its scaling); sliding ones: Gemma 3's local base."""
        super().init_rope(max_len)
        local = self.config
        if self.config.rope_local_theta is not None:
            local = dataclasses.replace(self.config, rope_theta=self.config.rope_local_theta, rope_scaling=None)
        self.local_rope = RotaryEmbedding(local, max_len, self.device, self.dtype)

    def rope_for(self, kind: str) -> Optional[RotaryEmbedding]:
        return self.local_rope if kind == "sliding" else self.rope

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        assert self.rope is not None and self.local_rope is not None, "call init_rope() after loading weights"
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        for kind, layer in zip(self.config.layer_kinds, self.model.layers):
            x = layer(x, positions, self.rope_for(kind), ctx)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
