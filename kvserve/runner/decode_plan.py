"""A decode step's decoder layers as one flat loop of the calls the modules would make.

At batch 1 a SmolLM2 decode step spent about 3 ms around its 3.7 ms of products: three module
frames a layer, the checks each module makes to pick its kernel, the attention layer's trip
through the backend and the storage. Once the model is loaded and its backend installed those
choices come out the same at every decode step, so `DecodePlan.build` makes them once and the
plan runs each layer as the kernel calls the modules make, in the same order on the same
arguments: its hidden states equal the modules' bit for bit (tests/runner/test_decode_plan.py).
The CPU's answer to replaying a captured graph.

It covers Llama-family models (`LlamaForCausalLM`'s own layers) on CPU whose q/k/v and gate/up
products are fused (packed weights), with the layer kernels built and the CPU attention kernel as
backend, and steps where every row is a decode over a cache in any format with no attention sinks.
Anything else (prefill chunks, mixed steps, sinks, another model, tensor parallelism, compiled
kernels off) takes the modules.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from kvserve import kernels
from kvserve.attention.cpu_kernel import CpuKernelAttentionBackend
from kvserve.attention.layer import ForwardContext
from kvserve.models.linear import Linear
from kvserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, RMSNorm
from kvserve.models.packed import PackedLinear


class _Layer(NamedTuple):
    norm1: torch.Tensor
    eps1: float
    qkv: nn.Module  # the fused q|k|v product
    heads: int
    kv_heads: int
    cache_layer: int  # the attention layer's index in the cache
    group: int  # its cache group
    scale: float
    o_proj: nn.Module
    norm2: torch.Tensor
    eps2: float
    gate_up: nn.Module  # the fused gate|up product
    down_proj: nn.Module


class DecodePlan:
    def __init__(self, model: LlamaForCausalLM, backend: CpuKernelAttentionBackend, ops: Any) -> None:
        self.model, self.backend, self.ops = model, backend, ops
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                layer.input_layernorm.weight, layer.input_layernorm.eps, a.fused_q_k_v.fused,
                a.num_heads, a.num_kv_heads, a.attn.layer_idx, a.attn.group, a.attn.scale, a.o_proj,
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                m.fused_gate_up.fused, m.down_proj))

    @classmethod
    def build(cls, model: nn.Module, backend: Any) -> Optional["DecodePlan"]:
        """The plan for this model and backend, or None where the modules must run (the reason
        is one of the conditions the module docstring lists)."""
        ops = kernels.load("layer_ops")
        if (ops is None or type(model).forward is not LlamaForCausalLM.forward
                or not isinstance(model, LlamaForCausalLM) or type(backend) is not CpuKernelAttentionBackend
                or model.device.type != "cpu"):
            return None
        norm = model.model.norm
        if type(norm) is not RMSNorm or norm.ops is None:
            return None
        for layer in model.model.layers:
            if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention \
                    or type(layer.mlp) is not LlamaMLP or layer.mlp.ops is None:
                return None
            a, m = layer.self_attn, layer.mlp
            if ("fused_q_k_v" not in a._modules or "fused_gate_up" not in m._modules or a.attn.softcap is not None
                    or a.attn.backend is not backend
                    or not all(isinstance(p, (Linear, PackedLinear)) for p in (a.o_proj, m.down_proj))
                    or any(type(n) is not RMSNorm or n.ops is None
                           for n in (layer.input_layernorm, layer.post_attention_layernorm))):
                return None
        return cls(model, backend, ops)

    def covers(self, num_tokens: int, ctx: ForwardContext) -> bool:
        """Whether this step is one the plan runs: every row a decode, no attention sinks."""
        if ctx.storage is None or self.model.rope is None or self.model.rope.ops is None:
            return False
        return all(m.num_decode_tokens == num_tokens and m.slot_mapping is not None and not m.sinks
                   and m.sink_rotation is None for m in ctx.metadata)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden], as LlamaForCausalLM.forward."""
        ops, storage, model = self.ops, ctx.storage, self.model
        assert storage is not None and model.rope is not None
        attend = self.backend.module
        cos, sin = model.rope._angles(positions)
        x = model.model.embed_tokens(input_ids)
        T = x.shape[0]
        residual = x
        h = ops.rms_norm(x, self.layers[0].norm1, self.layers[0].eps1)
        for i, L in enumerate(self.layers):
            if i:
                h = ops.add_rms_norm(x, residual, L.norm1, L.eps1)
            q, k, v = ops.rope_qkv(L.qkv.forward(h), cos, sin, L.heads, L.kv_heads)
            meta = ctx.metadata[L.group]
            storage.write(L.cache_layer, k, v, meta.kv_write_plan)
            entry, operands = storage.decode_operands(L.cache_layer)
            out = getattr(attend, entry)(q, *operands, meta.decode_block_tables, meta.decode_context_lens, L.scale,
                                         meta.sliding_window or 0)
            h = ops.add_rms_norm(L.o_proj.forward(out.view(T, -1)), residual, L.norm2, L.eps2)
            x = L.down_proj.forward(ops.silu_mul_halves(L.gate_up.forward(h)))
        norm = model.model.norm
        return ops.add_rms_norm(x, residual, norm.weight, norm.eps)  # type: ignore[no-any-return]
