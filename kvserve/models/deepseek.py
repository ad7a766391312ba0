"""DeepSeek-V2 and V3 decoders: multi-head latent attention (MLA) over a latent cache.

Each layer compresses a token's keys and values into one latent c_kv [kv_lora_rank] (after
kv_a_layernorm) and one rotary key k_rope [qk_rope_head_dim] shared by the heads; the cache holds
only those (kvserve.kv.latent). Per head h the full key and value would be

    k_h = [W_UK_h c_kv | k_rope]        v_h = W_UV_h c_kv        (kv_b_proj = [W_UK; W_UV] per head)

and the attention reads them without expanding them (the absorbed form):

    q_latent_h = W_UK_h^T q_nope_h                  [kv_lora_rank]: W_UK folded into the query
    score      = q_latent_h . c_kv + q_rope_h . k_rope   (times the softmax scale)
    out_h      = W_UV_h (sum_j p_j c_kv_j)          W_UV applied after attention, then o_proj

so attention is multi-query attention with one 576-wide key (the cache row [c_kv | k_rope]) and
a 512-wide value (its latent part): the backends serve it as any storage's K/V, through the block
table. That is how decodes and chunks with cached context attend; a step of prompt chunks that
each start their sequence attends in the expanded form instead, cheaper there
(starts_every_sequence), writing the same latent rows to the cache. Queries come from q_proj (V2-Lite) or a low-rank q_a_proj -> q_a_layernorm -> q_b_proj
(V2, V3). DeepSeek lays rotary pairs out interleaved ((x0, x1), (x2, x3), ...); q_rope and k_rope
are de-interleaved (evens, then odds) before the halves rotation, the same dot products. YaRN
scaling (rope_scaling type "yarn") scales the rotation tables by its attention factor and the
softmax scale by mscale(factor, mscale_all_dim)^2, as DeepSeek does.

MLP: dense (the Llama MLP) where the model's MoEConfig says so (DeepSeek's first_k_dense_replace
layers), else the routed experts with shared experts (kvserve.models.moe).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.layer import Attention, ForwardContext
from kvserve.config import MLAConfig, ModelConfig
from kvserve.kv.storage import KVStorage
from kvserve.models.linear import Linear
from kvserve.models.moe import DeepseekMoeBlock, moe_mlp
from kvserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, RMSNorm, RotaryEmbedding, \
    make_embedding

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm keep their own default eps in DeepSeek's code


def mla_of(config: ModelConfig) -> MLAConfig:
    if config.mla is None:
        raise ValueError(f"{config.name} has no latent attention (MLAConfig): not a DeepSeek-V2/V3 config")
    return config.mla


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: ModelConfig) -> float:
    """1 / sqrt(qk_nope + qk_rope), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    m = mla_of(config)
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    s = config.rope_scaling or {}
    if s.get("rope_type", s.get("type", "default")) != "default" and s.get("mscale_all_dim"):
        scale *= yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2
    return scale


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [qk_rope_head_dim / 2] and the factor the cos/sin tables are scaled by
    (YaRN's attention factor; 1 without scaling)."""
    dim, base = mla_of(config).qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    s = config.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise ValueError(f"unsupported rope scaling type {kind!r} for DeepSeek (default or yarn)")
    return _yarn_inv_freq(pos_freqs, dim, base, s), _yarn_attention_factor(s)


def _yarn_attention_factor(s: dict[str, Any]) -> float:
    factor = float(s["factor"])
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(factor, float(s["mscale"])) / yarn_mscale(factor, float(s["mscale_all_dim"]))
    return yarn_mscale(factor)


def _yarn_inv_freq(pos_freqs: torch.Tensor, dim: int, base: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolated frequencies for slow dimensions, the original ones for fast ones, a
    linear ramp between (bounds from beta_fast and beta_slow rotations over the original length)."""
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(float(s.get("beta_fast") or 32)), correction_dim(float(s.get("beta_slow") or 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class DeepseekRotaryEmbedding(RotaryEmbedding):
    """RoPE over the qk_rope_head_dim channels, YaRN-scaled where the config says so."""

    def __init__(self, config: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        self.inv_freq, factor = rope_frequencies(config)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), self.inv_freq)
        self.cos = (freqs.cos() * factor).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * factor).to(device=device, dtype=dtype)
        self._last: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self.ops = kernels.load("layer_ops")


class MLAttention(nn.Module):
    """Multi-head latent attention (the module header above): q, c_kv and k_rope in, the latent
    cache written and read through the engine's backend, o_proj out."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        m = mla_of(config)
        self.num_heads, self.mla = config.num_attention_heads, m
        hidden, bias, qk_dim = config.hidden_size, config.attention_bias, m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(m.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, m.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        # never a product of its own: its rows are folded into the query and the output, so it
        # stays a plain weight (kvserve's Linear would reorder it for oneDNN)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = Linear(self.num_heads * m.v_head_dim, hidden, bias=bias)
        self.attn = Attention(layer_idx, softmax_scale(config))
        self._absorbed: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.metadata[self.attn.group]
        if starts_every_sequence(meta, ctx.storage, x.dtype):
            return self.prefill_expanded(x, positions, rope, ctx, meta)
        T, H, m = x.shape[0], self.num_heads, self.mla
        q_nope, q_rope, c_kv, k_rope = self.projections(x, positions, rope)
        w_uk, w_uv = self.up_projections()  # [H, nope, rank], [H, v, rank]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # W_UK folded into the query
        q = torch.cat([q_latent, q_rope], dim=-1)  # [T, H, rank + rope]
        row = torch.cat([c_kv.unsqueeze(1), k_rope], dim=-1)  # [T, 1, rank + rope]: the cache row
        o_latent = self.attn(q, row, row[..., :m.kv_lora_rank], ctx)  # [T, H, rank]
        out = torch.einsum("thr,hvr->thv", o_latent, w_uv)  # W_UV after attention
        return self.o_proj(out.reshape(T, H * m.v_head_dim))

    def prefill_expanded(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                         ctx: ForwardContext, meta: AttentionMetadata) -> torch.Tensor:
        """Prompt chunks that start their sequences, in the expanded form: the latent rows go to
        the cache, and each chunk attends causally to its own per-head keys and values."""
        T, H, m = x.shape[0], self.num_heads, self.mla
        q_nope, q_rope, c_kv, k_rope = self.projections(x, positions, rope)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [T, H, nope + rope]
        row = torch.cat([c_kv.unsqueeze(1), k_rope], dim=-1)
        assert self.attn.backend is not None, "the runner installs an attention backend before a forward pass"
        self.attn.backend.write_kv(self.attn.layer_idx, row, row[..., :m.kv_lora_rank], ctx.storage, meta)
        keys, values = self.expand(c_kv, k_rope)
        out = x.new_empty(T, H, m.v_head_dim)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys[rows].transpose(0, 1)[None], values[rows].transpose(0, 1)[None],
                is_causal=True, scale=self.attn.scale)[0].transpose(0, 1)
        return self.o_proj(out.reshape(T, H * m.v_head_dim))

    def projections(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_nope [T, H, nope], q_rope [T, H, rope] (rotated), c_kv [T, rank], k_rope [T, 1, rope]."""
        q_nope, q_rope = self.query(x).split([self.mla.qk_nope_head_dim, self.mla.qk_rope_head_dim], dim=-1)
        return (q_nope, self._rotate(q_rope, positions, rope), *self.latent(x, positions, rope))

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, qk_nope + qk_rope], before RoPE."""
        q = self.q_proj(x) if self.mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, -1)

    def latent(self, x: torch.Tensor, positions: torch.Tensor,
               rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache keeps of each token: c_kv [T, kv_lora_rank] (normalized) and the
        rotated shared key k_rope [T, 1, qk_rope_head_dim]."""
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.mla.kv_lora_rank, self.mla.qk_rope_head_dim], -1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        return c_kv, self._rotate(k_rope.unsqueeze(1), positions, rope)

    def expand(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [S, H, qk_nope + qk_rope] and values [S, H, v_head_dim] from latents (the
        form the absorbed attention avoids: what an MHA cache of this model would hold)."""
        w_uk, w_uv = self.up_projections()
        k_nope = torch.einsum("sr,hnr->shn", c_kv, w_uk)
        keys = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1)], dim=-1)
        return keys, torch.einsum("sr,hvr->shv", c_kv, w_uv)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, qk_nope, rank] and W_UV [H, v, rank]: kv_b_proj's rows per head, views of its
        weight (taken once, after the weights are loaded)."""
        if self._absorbed is None or self._absorbed[0].device != self.kv_a_layernorm.weight.device:
            weight = getattr(self.kv_b_proj, "weight", None)
            if not isinstance(weight, torch.Tensor):
                raise ValueError("MLA folds kv_b_proj into the query and output: it needs a float kv_b_proj "
                                 "weight, not a packed one (load with a float weight dtype)")
            m = self.mla
            per_head = weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
            self._absorbed = (per_head[:, :m.qk_nope_head_dim], per_head[:, m.qk_nope_head_dim:])
        return self._absorbed

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        if self.mla.rope_interleave:  # interleaved pairs -> halves: evens, then odds
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return rope(x.contiguous(), positions)


def starts_every_sequence(meta: AttentionMetadata, storage: Optional[KVStorage], dtype: torch.dtype) -> bool:
    """Whether a step is prompt chunks that each start their sequence (no decode, no cached
    context) over a cache that reads back what is written: there the expanded form is cheaper.
    Per token both forms pay the up-projections once (W_UK and W_UV on the query and the output,
    or on the latent: the same products); per query-key pair and head the expanded form takes
    (nope + rope) + v products, the absorbed one 2 rank + rope (DeepSeek: 320 against 1,088).
    A decode reads a long cached context for one query: absorbed, never expanding the cache."""
    return (meta.num_decode_tokens == 0 and bool(meta.prefills)
            and all(s.context_len == s.q_len for s in meta.prefills)
            and (storage is None or storage.reads_back_exactly(dtype)))


class ExpandedMLAttention(MLAttention):
    """The same attention over a per-head cache: keys [T, H, qk_nope + qk_rope] and values
    expanded from the latents (values zero-padded to the key's width, so one dense storage holds
    both), what an MHA cache of these heads would hold: the baseline the latent cache is measured
    against (MLAConfig.cache_form "expanded")."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        T, m = x.shape[0], self.mla
        q_nope, q_rope, c_kv, k_rope = self.projections(x, positions, rope)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [T, H, nope + rope]
        keys, values = self.expand(c_kv, k_rope)
        values = F.pad(values, (0, q.shape[-1] - m.v_head_dim))
        out = self.attn(q, keys, values, ctx)[..., :m.v_head_dim]
        return self.o_proj(out.reshape(T, self.num_heads * m.v_head_dim))


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """The Llama layer's residual flow with latent attention and a dense or MoE MLP."""

    def attention_for(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        form = MLAttention if mla_of(config).caches_latent else ExpandedMLAttention
        return form(config, layer_idx)

    def mlp_for(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return make_mlp(config, layer_idx)


def make_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Dense where the model has no experts or moe.dense_layers names the layer, else routed."""
    return LlamaMLP(config) if config.moe is None else moe_mlp(config, layer_idx, DeepseekMoeBlock)


class DeepseekModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(LlamaForCausalLM):
    model_class = DeepseekModel
    float_weights = ("kv_b_proj.weight",)  # folded into queries and outputs, never packed (build_model)

    def init_rope(self, max_len: int) -> None:
        self.rope = DeepseekRotaryEmbedding(self.config, max_len, self.device, self.dtype)
