"""Gemma 2 and Gemma 3 (text) decoders over a flat token batch, assembled from the Llama family's
fast building blocks (norms, RoPE, attention, packed products) for what these families do
differently (names follow Hugging Face, so loading is a rename table):

    embeddings      scaled by sqrt(hidden_size)
    norms           RMSNorm times (1 + weight): an RMSNorm whose weight is stored plus one (the
                    loaders add it once: Hugging Face keeps w, llama.cpp's GGUF already 1 + w);
                    one after attention and one before and after the MLP besides the input norm;
                    Gemma 3 also normalizes q and k per head
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
from kvserve.models.llama import (LlamaAttention, LlamaForCausalLM, LlamaMLP, Methods, RMSNorm, RotaryEmbedding,
                                  make_embedding)
from kvserve.models.qwen3 import Qwen3Attention
from kvserve.modules import DirectCall, FastPathEnv

NORM_NAMES = ("layernorm.weight", "norm.weight")  # every norm's weight ends so (q_norm, k_norm too)


def norms_plus_one(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face Gemma state dict with each norm's w stored as 1 + w (in fp32, as
    transformers computes 1 + w, whatever the checkpoint's dtype)."""
    return {k: v.float() + 1.0 if k.endswith(NORM_NAMES) else v for k, v in state_dict.items()}


def gemma_attention(config: ModelConfig, layer_idx: int) -> Attention:
    """Gemma's attention proper: its query scale, and Gemma 2's score cap."""
    return Attention(layer_idx, config.attention_scale, config.attn_logit_softcapping)


class GemmaAttention(LlamaAttention):
    """Gemma 2: Llama's attention (its fast form too: q|k|v rotated and split in one call) with
    Gemma's attention proper."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.attn = gemma_attention(config, layer_idx)


class GemmaQKNormAttention(Qwen3Attention):
    """Gemma 3: Qwen3's attention (q and k normalized per head before RoPE; the norms hold 1 + w)
    with Gemma's attention proper."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.attn = gemma_attention(config, layer_idx)


class GemmaMLP(LlamaMLP):
    """GeGLU: Llama's MLP (its products, fused gate|up where packed) with gelu_tanh for silu."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_gate_up
        gate, up = fused.split(x) if fused is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)

    def fast_methods(self, env: FastPathEnv) -> Methods:
        """A fused gate|up product split once, its children's bound forms called directly."""
        if env.cpu_ops is None or self.fused_gate_up is None:
            return {}

        def forward(x: torch.Tensor) -> torch.Tensor:
            gate, up = self.fused_gate_up.split(x)
            return self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)  # type: ignore[no-any-return]
        return {"forward": forward}


class GemmaDecoderLayer(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        attention = GemmaQKNormAttention if config.architecture == "gemma3" else GemmaAttention
        self.self_attn = attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext,
                residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: x is the previous layer's output not yet added to the residual
        stream (the embeddings, residual None, for the first layer); each add is made by the norm
        that follows it. Gemma's norms after attention and after the MLP apply before the add."""
        if residual is None:
            residual, h = x, self.input_layernorm.forward(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm.forward(self.self_attn.forward(h, positions, rope, ctx))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm.forward(self.mlp.forward(h)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


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
        x, residual = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype), None
        for kind, layer in zip(self.config.layer_kinds, self.model.layers):
            x, residual = layer.forward(x, positions, self.rope_for(kind), ctx, residual)
        return self.model.norm.add_forward(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
