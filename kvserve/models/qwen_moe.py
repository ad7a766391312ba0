"""Qwen2-MoE and Qwen3-MoE: Llama layers whose MLPs are routed experts (kvserve.models.moe).

Qwen2-MoE: q, k, v with biases (Llama's attention with attention_bias), softmax routing over
num_experts, and a shared expert scaled by sigmoid(shared_expert_gate(x)).
Qwen3-MoE: Qwen3's attention (q and k RMS-normalized per head before RoPE, kvserve.models.qwen3);
softmax routing, top-k renormalized where norm_topk_prob; no shared expert.
Both place dense MLPs on mlp_only_layers and off every decoder_sparse_step-th layer (the loader
turns those into MoEConfig.dense_layers).
"""

from __future__ import annotations

from kvserve.models.moe import MoeDecoderLayer, MoeForCausalLM, MoeModel
from kvserve.models.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3MoeModel(MoeModel):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoeForCausalLM):
    model_class = Qwen3MoeModel


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Llama's attention (with q, k, v biases from the config) and the shared-expert block."""
