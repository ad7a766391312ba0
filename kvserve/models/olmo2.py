"""OLMo-2: the norms come after attention and after the MLP, on their outputs, before each is
added to the residual stream (no norm before them), and q and k are RMS-normalized over the whole
projection (all heads together) before RoPE:

    h = x + post_attention_layernorm(attn(x))       q = rope(q_norm(q_proj(x)))  [T, heads * D]
    y = h + post_feedforward_layernorm(mlp(h))      k = rope(k_norm(k_proj(x)))
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from kvserve.attention.layer import ForwardContext
from kvserve.config import ModelConfig
from kvserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm, RotaryEmbedding, \
    make_embedding
from kvserve.modules import DirectCall, FastPathEnv


class Olmo2RMSNorm(RMSNorm):
    """OLMo-2 multiplies by the weight in fp32 and then rounds, (w * x_hat).to(dtype), where
    RMSNorm rounds first, w * x_hat.to(dtype): the same in fp32, where it takes RMSNorm's kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32:
            return super().add_forward(x, residual)
        residual = residual + x
        return self.forward(residual), residual

    def fast_methods(self, env: FastPathEnv) -> dict[str, Callable[..., Any]]:
        return super().fast_methods(env) if env.dtype == torch.float32 else {}


class Olmo2Attention(LlamaAttention):
    """LlamaAttention with q_norm [heads * D] and k_norm [kv_heads * D] over the projections."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = Olmo2RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q = rope(self.q_norm(self.q_proj(x)).view(T, self.num_heads, self.head_dim), positions)
        k = rope(self.k_norm(self.k_proj(x)).view(T, self.num_kv_heads, self.head_dim), positions)
        return self.attend(q, k, self.v_proj(x).view(T, self.num_kv_heads, self.head_dim), ctx)


class Olmo2DecoderLayer(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_idx)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext,
                residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: x is the previous layer's output, not yet added to the stream
        (the embeddings and residual None for the first layer); returns this layer's output,
        normalized, and the stream it is to be added to."""
        stream = x if residual is None else residual + x
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, positions, rope, ctx))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_class = Olmo2Model
