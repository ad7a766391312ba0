"""Phi-3 and Phi-4-mini: Llama's layers (their fused qkv_proj and gate_up_proj are split into
q/k/v and gate/up when loaded, and fused again for packed weights by build_model), with partial
rotary in Phi-4-mini: RoPE turns the first `rotary_dim` dims of each head (3/4 of them), the
rest pass through; and longrope scaling (Phi-3's 128k models, Phi-4-mini): per-frequency factors,
short ones up to original_max_position_embeddings, long ones past it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
from torch import nn

from kvserve.attention.layer import ForwardContext
from kvserve.config import ModelConfig
from kvserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, RotaryEmbedding

logger = logging.getLogger(__name__)


class PartialRopeAttention(LlamaAttention):
    """LlamaAttention whose RoPE (tables of rotary_dim / 2 angles) turns the leading rotary_dim
    dims of each q and k head; the others are kept as projected."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.rotary_dim = config.rotary_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.project(x)
        return self.attend(self.rotate(q, positions, rope), self.rotate(k, positions, rope), v, ctx)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        """x [T, heads, D] with x[..., :rotary_dim] turned: a new [T, heads, D]."""
        d = self.rotary_dim
        return torch.cat((rope(x[..., :d], positions), x[..., d:]), dim=-1)


class LongRopeEmbedding(RotaryEmbedding):
    """Longrope: inverse frequencies 1 / (factor_i * theta ** (2i / rotary_dim)), with the short
    factors for positions below original_max_position_embeddings and the long ones from there on,
    cos and sin times attention_factor. Inside the original length this is transformers' rotation.
    Past it, transformers turns the whole sequence by the long factors (its Phi-3 drops its cache
    and re-encodes the sequence when it crosses); kvserve keeps the keys it cached, turned by the
    short factors, so there its logits differ from transformers' (a warning says so)."""

    def __init__(self, config: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(dataclasses.replace(config, rope_scaling=None), max_len, device, dtype)
        s = config.rope_scaling or {}
        exponents = torch.arange(0, config.rotary_dim, 2, dtype=torch.int64).float() / config.rotary_dim
        short, long = (1.0 / (torch.tensor(s[k], dtype=torch.float32) * config.rope_theta ** exponents)
                       for k in ("short_factor", "long_factor"))
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.where((positions < s["original_max_position_embeddings"]).unsqueeze(1),
                            torch.outer(positions, short), torch.outer(positions, long))  # [max_len, rotary_dim / 2]
        factor = float(s["attention_factor"])
        if max_len > s["original_max_position_embeddings"]:
            logger.warning("%s: longrope past %d positions turns each new position by the long factors and "
                           "keeps the keys cached before (transformers re-encodes the whole sequence by them): "
                           "past that length logits differ from transformers'", config.name,
                           s["original_max_position_embeddings"])
        self.inv_freq = short
        self.cos = (freqs.cos() * factor).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * factor).to(device=device, dtype=dtype)


def is_longrope(config: ModelConfig) -> bool:
    return (config.rope_scaling or {}).get("rope_type") == "longrope"


class Phi3DecoderLayer(LlamaDecoderLayer):
    def attention_for(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if config.rotary_dim < config.head_dim:
            return PartialRopeAttention(config, layer_idx)
        return LlamaAttention(config, layer_idx)


class Phi3Model(LlamaModel):
    layer_class = Phi3DecoderLayer


class Phi3ForCausalLM(LlamaForCausalLM):
    model_class = Phi3Model

    def init_rope(self, max_len: int) -> None:
        if is_longrope(self.config):
            self.rope = LongRopeEmbedding(self.config, max_len, self.device, self.dtype)
        else:
            super().init_rope(max_len)

    def rope_for(self, kind: str) -> Optional[RotaryEmbedding]:
        """None with partial rotary (a sink's rotation would turn whole heads) or longrope (one
        turn by a distance does not fit both factor sets)."""
        partial = self.config.rotary_dim < self.config.head_dim
        return None if partial or is_longrope(self.config) else self.rope
