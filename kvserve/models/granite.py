"""Granite (dense): Llama's layers with four multipliers from the config:

    x0 = embed(ids) * embedding_multiplier
    h  = x + attn(norm(x)) * residual_multiplier,  y = h + mlp(norm(h)) * residual_multiplier
    attention scale = attention_multiplier (not head_dim ** -0.5: ModelConfig.attention_scale)
    logits = lm_head(norm(y)) / logits_scaling
"""

from __future__ import annotations

from typing import Optional

import torch

from kvserve.attention.layer import ForwardContext
from kvserve.config import ModelConfig
from kvserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, RotaryEmbedding


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext,
                residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaDecoderLayer's, each block's output scaled before it joins the stream."""
        m = self.residual_multiplier
        if residual is None:
            residual, h = x, self.input_layernorm.forward(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(
            self.self_attn.forward(h, positions, rope, ctx) * m, residual)
        return self.mlp.forward(h) * m, residual


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer


class GraniteForCausalLM(LlamaForCausalLM):
    model_class = GraniteModel

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.config.embedding_multiplier  # type: ignore[no-any-return]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) / self.config.logits_scaling).float()  # divided in the dtype, as Granite
