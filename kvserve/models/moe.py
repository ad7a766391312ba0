"""Mixture-of-experts MLPs: a router picks each token's experts, and only those experts run.

A layer holds E small SwiGLU MLPs (the experts) and a router, one [E, hidden] matrix. Per token,
the router scores every expert and keeps the best k; the layer's output is the sum of those k
experts' outputs weighted by their scores. The routing rule is data (`MoEConfig`, one `Router`
class): softmax or sigmoid scores, DeepSeek's grouped top-k with its score-correction bias,
renormalized or raw weights, a routed scaling factor.

The experts run grouped (`grouped_experts`): the batch's (token, expert) pairs are sorted by
expert, each active expert multiplies the rows of all its tokens in one product, and the weighted
results are added back into their tokens' rows:

    ids [T, k]     t0: (3, 1)  t1: (1, 6)  t2: (3, 6)
    sorted pairs   e1: t0 t1 | e3: t0 t2 | e6: t1 t2     (experts 0, 2, 4, 5, 7 not read)
    out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])   the rows put back in token order

so a decode step reads the weights of the experts its tokens chose, not all E. Each expert is
an ordinary `LlamaMLP` with Hugging Face's names (mlp.experts.{e}.gate_proj, ...), so packed
weights, int8/int4 quantization, the fused gate|up product and the MLP's fast form apply to
each expert as they do to a dense MLP.

Blocks (both `forward(x [T, hidden]) -> [T, hidden]`, built as `Block(config, layer_idx)` from a
`ModelConfig` whose `moe` is set):
- `SparseMoeBlock`: router `gate`, `experts`, and where the config has one a `shared_expert`
  (an MLP every token passes through) scaled by a sigmoid `shared_expert_gate` (Qwen2-MoE).
  Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.
- `DeepseekMoeBlock`: router `gate` (with `e_score_correction_bias` where moe.score_correction_bias),
  `experts`, and `shared_experts`, one MLP of moe.shared_expert_intermediate_size
  (= moe_intermediate_size * n_shared_experts) added ungated. DeepSeek-V2/V3.
`moe_mlp(config, layer_idx)` gives a layer its MLP: the block, or a dense `LlamaMLP` for the
layers `moe.dense_layers` names (first_k_dense_replace, mlp_only_layers, decoder_sparse_step).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig, MoEConfig
from kvserve.models.linear import Linear
from kvserve.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, RMSNorm,
                                  make_embedding)
from kvserve.modules import DirectCall


def moe_of(config: ModelConfig) -> MoEConfig:
    if config.moe is None:
        raise ValueError(f"{config.name}: an MoE layer needs ModelConfig.moe (the experts and their routing)")
    return config.moe


class Router(DirectCall, nn.Module):
    """Scores [T, E] -> each token's k experts and their weights, by the rule in MoEConfig.
    `weight` [E, hidden] is the router (HF's mlp.gate.weight); `e_score_correction_bias` [E]
    (DeepSeek-V3) shifts which experts are chosen, never the weights they get."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size), requires_grad=False)
        bias = torch.zeros(moe.num_experts) if moe.score_correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)  # None: no such buffer in the state dict

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        logits = F.linear(x, self.weight).float()  # [T, E]
        scores = logits.softmax(-1) if self.moe.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if self.moe.n_group > 1:
            choice = self._within_best_groups(choice)
        ids = choice.topk(self.moe.num_experts_per_tok, dim=-1).indices  # [T, k]
        weights = scores.gather(1, ids)
        if self.moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.moe.routed_scaling_factor != 1.0:
            weights = weights * self.moe.routed_scaling_factor
        return weights, ids

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with every expert outside the topk_group best groups set to -inf."""
        T, moe = choice.shape[0], self.moe
        grouped = choice.view(T, moe.n_group, moe.num_experts // moe.n_group)
        if moe.group_score == "max":
            group_scores = grouped.max(-1).values  # [T, G]
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        best = group_scores.topk(moe.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, moe.num_experts)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: nn.ModuleList) -> torch.Tensor:
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for every token t, each active expert
    called once on all its tokens (see the module's drawing). x [T, hidden] -> [T, hidden].
    The outputs land in expert order and are put back in (token, choice) order by one
    index_copy_, then weighed and summed over the k choices (index_add_ on CPU is about a
    thousand times slower than index_copy_ on these small rows)."""
    T, k = ids.shape
    flat = ids.reshape(-1)  # [T k]: pair p is token p // k's (p % k)-th choice
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    tokens = order // k
    by_expert = x.new_empty(T * k, x.shape[1])  # [T k, hidden], rows in `order`
    start = 0
    for e, n in enumerate(counts):
        if n:
            by_expert[start:start + n] = experts[e].forward(x[tokens[start:start + n]])
            start += n
    by_pair = torch.empty_like(by_expert).index_copy_(0, order, by_expert).view(T, k, -1)
    return (by_pair * weights.to(x.dtype).unsqueeze(-1)).sum(1)


def dense_mlp(config: ModelConfig, intermediate_size: int) -> LlamaMLP:
    """A SwiGLU MLP of the given width (an expert, a shared expert)."""
    return LlamaMLP(dataclasses.replace(config, intermediate_size=intermediate_size))


def make_experts(config: ModelConfig, moe: MoEConfig) -> nn.ModuleList:
    return nn.ModuleList(dense_mlp(config, moe.moe_intermediate_size) for _ in range(moe.num_experts))


class RoutedExpertsBlock(DirectCall, nn.Module):
    """What every MoE MLP holds: the router (`gate`) and the routed experts (`experts`); the
    families differ in the shared experts they add (subclasses)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.moe = moe_of(config)
        self.layer_idx = layer_idx
        self.gate = Router(config.hidden_size, self.moe)
        self.experts = make_experts(config, self.moe)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the routed experts' weighted sum [T, hidden]."""
        weights, ids = self.gate.forward(x)
        return grouped_experts(x, weights, ids, self.experts)


class SparseMoeBlock(RoutedExpertsBlock):
    """Routed experts, plus a shared expert where the config has one (Qwen2-MoE: scaled by
    sigmoid(shared_expert_gate(x)) where moe.shared_expert_gate). See the module docstring."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        shared = self.moe.shared_expert_intermediate_size
        self.shared_expert = dense_mlp(config, shared) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if self.moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert.forward(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate.forward(x)) * shared
        return out + shared


class DeepseekMoeBlock(RoutedExpertsBlock):
    """DeepSeek-V2/V3's MLP: routed experts (softmax or sigmoid, grouped top-k, scaled) plus
    `shared_experts`, one MLP of moe.shared_expert_intermediate_size every token passes through
    (none where that is 0). `DeepseekMoeBlock(config, layer_idx)`, config.moe set."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        shared = self.moe.shared_expert_intermediate_size
        self.shared_experts = dense_mlp(config, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        return out if self.shared_experts is None else out + self.shared_experts.forward(x)


def moe_mlp(config: ModelConfig, layer_idx: int, block: type[nn.Module] = SparseMoeBlock) -> nn.Module:
    """The layer's MLP: the routed block, or a dense MLP on the layers moe.dense_layers names."""
    return block(config, layer_idx) if moe_of(config).is_sparse(layer_idx) else LlamaMLP(config)


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer (pre-norms, the residual adds made by the norms, Llama's forward)
    whose attention is `attention_class` and whose MLP is `moe_mlp`'s."""

    attention_class: type[nn.Module] = LlamaAttention

    def attention_for(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return self.attention_class(config, layer_idx)

    def mlp_for(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return moe_mlp(config, layer_idx)


class MoeModel(nn.Module):
    """embed_tokens, layers of `layer_class`, norm: what LlamaForCausalLM's frame runs."""

    layer_class: type[nn.Module] = MoeDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's frame (embeddings, RoPE, lm_head, the forward over the layers) around MoE layers."""

    model_class = MoeModel

