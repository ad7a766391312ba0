"""SmolLM3: Llama's layers where some layers (every fourth in the published models: the config's
`nope_layers`) turn no position into q and k (NoPE); their attention sees positions only through
the causal order."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvserve.attention.layer import ForwardContext
from kvserve.config import ModelConfig
from kvserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, RotaryEmbedding


class NoRopeAttention(LlamaAttention):
    """LlamaAttention with q and k as projected, RoPE left out."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.project(x)
        return self.attend(q, k, v, ctx)


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    def attention_for(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return NoRopeAttention(config, layer_idx) if layer_idx in config.nope_layers else \
            LlamaAttention(config, layer_idx)


class SmolLM3Model(LlamaModel):
    layer_class = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(LlamaForCausalLM):
    model_class = SmolLM3Model

    def rope_for(self, kind: str) -> Optional[RotaryEmbedding]:
        """None where NoPE layers are among them: no one rotation (a sink's) fits every layer."""
        return None if self.config.nope_layers else self.rope
