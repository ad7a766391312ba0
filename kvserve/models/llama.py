"""A Llama-family decoder (Llama 1-3, Mistral, Qwen2, SmolLM, llama2.c) over a flat token batch.

Tokens of many sequences are flattened into one [T] batch with their own positions; each
layer's `Attention` hands its q, k, v to the engine's backend, which reads and writes the cache
(`ForwardContext`). The model never sees block tables or the cache layout.
Parameter names follow Hugging Face, so every loader is a rename table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.attention.backend import LayerDecode, rotate_halves
from kvserve.attention.layer import Attention, ForwardContext
from kvserve.config import ModelConfig
from kvserve.models.linear import Linear
from kvserve.modules import DirectCall, FastPath, FastPathEnv, kernel_call, rows_op, runs_fast_form_of

Methods = dict[str, Callable[..., Any]]
Kernel = Callable[..., torch.Tensor]
LayerForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # a decoder layer's (output, residual)


class RMSNorm(DirectCall, FastPath, nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = kernels.load("layer_ops")  # one call on CPU (None: the torch ops below)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2 and x.device.type == "cpu" and x.dtype == self.weight.dtype:
            return self.ops.rms_norm(x, self.weight, self.eps)  # type: ignore[no-any-return]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual stream's add and this norm, one call on
        CPU (the kernel adds into `residual` in place and returns it; torch makes a new sum)."""
        if (self.ops is not None and x.dim() == 2 and x.device.type == "cpu" and x.dtype == self.weight.dtype
                and residual.dtype == x.dtype and residual.is_contiguous()):
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self.forward(residual), residual

    def norm_ops(self, env: FastPathEnv) -> Optional[tuple[Kernel, Kernel, torch.Tensor, float]]:
        """(rms_norm, add_rms_norm, weight, eps) where activations are in the weight's dtype on CPU
        with the kernels: forward(x) is rms_norm(x, weight, eps) for 2-D x, and add_forward(x,
        residual) is (add_rms_norm(x, residual, weight, eps), residual). None: the eager forms."""
        ops = env.cpu_ops if self.ops is not None else None
        if ops is None or env.dtype != self.weight.dtype:
            return None
        return ops.rms_norm, ops.add_rms_norm, self.weight, self.eps

    def fast_methods(self, env: FastPathEnv) -> Methods:
        """The kernels (a 2-D input: what a layer gives; other shapes take the eager forward)."""
        found = self.norm_ops(env)
        if found is None:
            return {}
        rms_norm, add_rms_norm, weight, eps = found
        eager = type(self).forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            return rms_norm(x, weight, eps) if x.dim() == 2 else eager(self, x)  # type: ignore[no-any-return]

        def add_forward(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return add_rms_norm(x, residual, weight, eps), residual
        return {"forward": forward, "add_forward": add_forward}


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] (rotary_dim: head_dim, or the leading part of a head
    partial rotary turns), with 'linear' or 'llama3' scaling from the config."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables [max_len, head_dim/2], computed in fp32 as Hugging Face does."""

    def __init__(self, config: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        self.inv_freq = rope_inv_freq(config)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), self.inv_freq)
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)
        self._last: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # positions, cos, sin
        self.ops = kernels.load("layer_ops")  # one call on CPU (None: torch)

    @property
    def max_len(self) -> int:
        return self.cos.shape[0]

    def rotation(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim/2] of turning each row by delta [T] positions (in fp32; the
        tables' dtype): R(delta) applied to a vector rotated at p gives it rotated at p + delta."""
        freqs = torch.outer(delta.float().cpu(), self.inv_freq)
        return (freqs.cos().to(device=self.cos.device, dtype=self.cos.dtype),
                freqs.sin().to(device=self.cos.device, dtype=self.cos.dtype))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by position; halves rotate together (HF layout)."""
        cos, sin = self.angles(positions)
        if self.ops is not None and x.device.type == "cpu" and x.stride(-1) == 1 and x.dtype == cos.dtype:
            return self.ops.rotate_halves(x, cos, sin)  # type: ignore[no-any-return]
        return rotate_halves(x, cos, sin)

    def rotate_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, heads: int,
                   kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D] and k [T, kv_heads, D] rotated, and v [T, kv_heads, D], from a fused
        q|k|v product [T, (heads + 2 kv_heads) D]: one call on CPU."""
        cos, sin = self.angles(positions)
        if self.ops is not None and qkv.device.type == "cpu" and qkv.stride(-1) == 1 and qkv.dtype == cos.dtype:
            q, k, v = self.ops.rope_qkv(qkv, cos, sin, heads, kv_heads)
            return q, k, v
        T, D = qkv.shape[0], qkv.shape[1] // (heads + 2 * kv_heads)
        q, k, v = qkv.split_with_sizes([heads * D, kv_heads * D, kv_heads * D], dim=-1)
        return (rotate_halves(q.view(T, heads, D), cos, sin), rotate_halves(k.view(T, kv_heads, D), cos, sin),
                v.view(T, kv_heads, D))

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim/2] of these positions, looked up once for every layer of a
        forward pass (each layer rotates q and k by the same positions tensor)."""
        if self._last is None or self._last[0] is not positions:
            self._last = (positions, self.cos[positions], self.sin[positions])
        return self._last[1], self._last[2]


class AttentionParts(NamedTuple):
    """An attention block's plain decode as compiled operations (LlamaAttention.decode_parts)."""

    qkv: Any  # the fused q|k|v product, a kvserve.RowsOp capsule (kernels/csrc/kernel_ops.h)
    o: Any  # o_proj's
    heads: int
    kv_heads: int
    decode: LayerDecode  # the cache write and the decode attention
    group: int  # the attention's cache group
    rows: float  # the most rows the products' kernels take


class OneCallLayer(NamedTuple):
    """A decoder layer's plain decode step as one compiled call (LlamaDecoderLayer.decode_layer):
    what a model running its layers as one call (LlamaForCausalLM's fast forward) takes from it."""

    layer: Any  # layer_ops' DecodeLayer
    group: int  # its attention's cache group
    rows: float  # the most rows it takes


class MlpParts(NamedTuple):
    """An MLP block's products as compiled operations (LlamaMLP.decode_parts): silu(gate) * up."""

    gate_up: Any  # the fused gate|up product, a kvserve.RowsOp capsule
    down: Any
    rows: float


class LlamaAttention(DirectCall, FastPath, nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.attn = Attention(layer_idx, config.attention_scale)
        self.fused_qkv: Optional[nn.Module] = None  # q, k and v packed as one product (packed.fuse)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D], not rotated: views of the products (a fused
        group's parts share one product, made once)."""
        T = x.shape[0]
        return (self.q_proj(x).view(T, self.num_heads, self.head_dim),
                self.k_proj(x).view(T, self.num_kv_heads, self.head_dim),
                self.v_proj(x).view(T, self.num_kv_heads, self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The attention over rotated q, k and v, through o_proj: [T, hidden]."""
        out = self.attn(q, k, v, ctx)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(q.shape[0], self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        if self.fused_qkv is not None:  # rotated and split in one call
            q, k, v = rope.rotate_qkv(self.fused_qkv.fused(x), positions, self.num_heads, self.num_kv_heads)
        else:
            q = rope(self.q_proj(x).view(T, self.num_heads, self.head_dim), positions)
            k = rope(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim), positions)
            v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, ctx)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))

    def fast_methods(self, env: FastPathEnv) -> Methods:
        """A fused q|k|v product rotated and split by the kernel (the eager path's choice for
        such a product on CPU in the tables' dtype); the products' kernels called here
        (kvserve.modules.kernel_call) up to the rows they take, their modules' forward above."""
        ops = env.cpu_ops
        if ops is None or self.fused_qkv is None:
            return {}
        rope_qkv, heads, kv_heads = ops.rope_qkv, self.num_heads, self.num_kv_heads
        qkv_fn, qkv_operands, qkv_rows, qkv = kernel_call(self.fused_qkv.fused, env)
        o_fn, o_operands, o_rows, o_proj = kernel_call(self.o_proj, env)

        def forward(x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                    ctx: ForwardContext) -> torch.Tensor:
            # the attention's forward looked up at each call (pinned: a dict lookup), so whatever
            # is bound in its place later (another backend, a timer) is what runs
            cos, sin = rope.angles(positions)
            rows = x.shape[0]
            q, k, v = rope_qkv(qkv_fn(x, *qkv_operands) if rows <= qkv_rows else qkv.forward(x), cos, sin,
                               heads, kv_heads)
            out = self.attn.forward(q, k, v, ctx).flatten(1)
            y = o_fn(out, *o_operands) if rows <= o_rows else o_proj.forward(out)
            return y  # type: ignore[no-any-return]
        return {"forward": forward}

    def decode_parts(self, env: FastPathEnv) -> Optional["AttentionParts"]:
        """What its fast form calls for a step of plain decodes, as compiled operations, for a
        decoder layer run as one call (LlamaDecoderLayer.decode_layer). None where this block
        does not run this class's fast form or a part has no such operation."""
        if self.fused_qkv is None or not runs_fast_form_of(self, LlamaAttention, ("forward",)):
            return None
        qkv, o = rows_op(self.fused_qkv.fused, env), rows_op(self.o_proj, env)
        attention = self.attn.layer_decode(env)
        if qkv is None or o is None or attention is None:
            return None
        rows = min(kernel_call(self.fused_qkv.fused, env).rows, kernel_call(self.o_proj, env).rows)
        return AttentionParts(qkv, o, self.num_heads, self.num_kv_heads, attention, self.attn.group, rows)


class LlamaMLP(DirectCall, FastPath, nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        # silu(gate) * up in one call on CPU (None: torch). Only the vector build: the portable one
        # is a scalar loop, slower than torch's two ops even on one row (9 vs 6 us; 5x on 64 rows)
        ops = kernels.load("layer_ops")
        self.ops = ops if ops is not None and ops.isa() != "portable" else None
        self.fused_gate_up: Optional[nn.Module] = None  # gate and up packed as one product (packed.fuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_gate_up
        if fused is not None and self.ops is not None and x.dim() == 2 and x.device.type == "cpu":
            return self.down_proj(self.ops.silu_mul_halves(fused.fused(x)))  # split inside the call
        gate, up = fused.split(x) if fused is not None else (self.gate_proj(x), self.up_proj(x))
        if self.ops is not None and gate.dim() == 2 and gate.device.type == "cpu" and gate.stride(-1) == 1:
            return self.down_proj(self.ops.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)

    def fast_methods(self, env: FastPathEnv) -> Methods:
        """A fused gate|up product through silu(gate) * up in one call (the vector builds), the
        products' kernels called here up to the rows they take."""
        if env.cpu_ops is None or self.ops is None or self.fused_gate_up is None:
            return {}
        silu_mul_halves = self.ops.silu_mul_halves
        up_fn, up_operands, up_rows, gate_up = kernel_call(self.fused_gate_up.fused, env)
        down_fn, down_operands, down_rows, down = kernel_call(self.down_proj, env)

        def forward(x: torch.Tensor) -> torch.Tensor:
            rows = x.shape[0]
            h = silu_mul_halves(up_fn(x, *up_operands) if rows <= up_rows else gate_up.forward(x))
            y = down_fn(h, *down_operands) if rows <= down_rows else down.forward(h)
            return y  # type: ignore[no-any-return]
        return {"forward": forward}

    def decode_parts(self, env: FastPathEnv) -> Optional["MlpParts"]:
        """Its fast form's products as compiled operations, for a decoder layer run as one call;
        None as LlamaAttention's."""
        if self.fused_gate_up is None or not runs_fast_form_of(self, LlamaMLP, ("forward",)):
            return None
        gate_up, down = rows_op(self.fused_gate_up.fused, env), rows_op(self.down_proj, env)
        if gate_up is None or down is None:
            return None
        rows = min(kernel_call(self.fused_gate_up.fused, env).rows, kernel_call(self.down_proj, env).rows)
        return MlpParts(gate_up, down, rows)


class LlamaDecoderLayer(DirectCall, FastPath, nn.Module):
    """Pre-norm attention and MLP. A family with other attention (q/k norms, no RoPE on some
    layers, partial rotary) is a subclass that names its class in `attention_for`; one with
    another MLP (routed experts) names it in `mlp_for`."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_for(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.mlp_for(config, layer_idx)

    def attention_for(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """This layer's attention block."""
        return LlamaAttention(config, layer_idx)

    def mlp_for(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """This layer's MLP block."""
        return LlamaMLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext,
                residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the embeddings
        and residual None for the first layer). Returns this layer's output and the stream: each
        add is made by the norm that follows it (RMSNorm.add_forward), one call instead of two.
        Its blocks are DirectCall modules: their forward is called as such, one frame fewer."""
        if residual is None:
            residual, h = x, self.input_layernorm.forward(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn.forward(h, positions, rope, ctx),
                                                                residual)
        return self.mlp.forward(h), residual

    def fast_methods(self, env: FastPathEnv) -> Methods:
        """The norms' kernels called here, where both norms run RMSNorm's fast form (the blocks
        between them are called as they are bound): two calls a layer fewer; and a step of plain
        decodes as one compiled call where the blocks allow it (decode_layer)."""
        replaced = ("forward", "add_forward")
        first, second = (n.norm_ops(env) if runs_fast_form_of(n, RMSNorm, replaced) else None
                         for n in (self.input_layernorm, self.post_attention_layernorm))
        if first is None or second is None:
            return {}
        (rms_norm, add_first, w_first, eps_first), (_, add_second, w_second, eps_second) = first, second

        def forward(x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext,
                    residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
            if residual is None:
                residual, h = x, rms_norm(x, w_first, eps_first)
            else:
                h = add_first(x, residual, w_first, eps_first)  # adds into residual
            h = add_second(self.self_attn.forward(h, positions, rope, ctx), residual, w_second, eps_second)
            return self.mlp.forward(h), residual
        fused = self.decode_layer(env, (w_first, eps_first), (w_second, eps_second), forward)
        return {"forward": forward if fused is None else fused}

    def decode_layer(self, env: FastPathEnv, first: tuple[torch.Tensor, float],
                     second: tuple[torch.Tensor, float], forward: LayerForward) -> Optional[LayerForward]:
        """`forward` (the fast form above, norms' weights and eps `first` and `second`) with a step
        of plain decodes as one compiled call (layer_ops' DecodeLayer: the kernels `forward` calls,
        in its order, on the same arguments, so the same outputs bit for bit), where env allows it
        (FastPathEnv.fused), this class's forward is the layer's, and each block has its parts as
        compiled operations; any other step through `forward`. None: the blocks one by one."""
        ops = env.cpu_ops
        if (not env.fused or ops is None or not hasattr(ops, "DecodeLayer")
                or type(self).forward is not LlamaDecoderLayer.forward):
            return None
        attention = getattr(self.self_attn, "decode_parts", None)
        mlp = getattr(self.mlp, "decode_parts", None)
        a = attention(env) if attention is not None else None
        m = mlp(env) if mlp is not None else None
        if a is None or m is None:
            return None
        layer = ops.DecodeLayer(first[0], first[1], second[0], second[1], a.qkv, a.o, m.gate_up, m.down,
                                a.decode.op, a.heads, a.kv_heads, a.decode.store, list(a.decode.cache))
        one_call = layer.forward
        group, most = a.group, min(a.rows, m.rows)

        def fused_forward(x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                          ctx: ForwardContext, residual: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
            meta = ctx.metadata[group]
            if not meta.plain_decode or x.shape[0] > most:
                return forward(x, positions, rope, ctx, residual)
            cos, sin = rope.angles(positions)
            out: tuple[torch.Tensor, torch.Tensor] = one_call(
                x, residual, cos, sin, meta.kv_write_plan, meta.decode_block_tables, meta.decode_context_lens,
                meta.sliding_window or 0)
            return out
        fused_forward.one_call = OneCallLayer(layer, group, most)  # type: ignore[attr-defined]
        return fused_forward


def make_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An embedding table. Built on the meta device (as build_model builds every model, to assign
    the loaded weights), it is left uninitialised: a random normal_ there imports torch._dynamo,
    about 3 s of every start, for a table that is replaced at once."""
    if torch.empty(0).device.type == "meta":
        return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
    return nn.Embedding(num_embeddings, embedding_dim)


class LlamaModel(nn.Module):
    layer_class: type[nn.Module] = LlamaDecoderLayer  # a family's layers: a subclass names its own

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class RecomputedLayers:
    """The first num_layers layers of a step run over whole sequences (they keep no cache:
    kvserve.runner.layer_recompute); the layers above take the rows new_rows of their output."""

    num_layers: int
    input_ids: torch.Tensor  # [S] every token of each sequence
    positions: torch.Tensor  # [S]
    new_rows: torch.Tensor  # [T] the step's new tokens among the S rows, in the step's order
    ctx: ForwardContext  # no storage: plain causal attention over each sequence


class LlamaForCausalLM(FastPath, nn.Module):
    model_class: type[nn.Module] = LlamaModel  # embed_tokens, layers, norm

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: Optional[RotaryEmbedding] = None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (what the norms hold; a packed weight has none of its own)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def init_rope(self, max_len: int) -> None:
        self.rope = RotaryEmbedding(self.config, max_len, self.device, self.dtype)

    def ensure_rope(self, num_positions: int) -> None:
        """RoPE tables covering positions [0, num_positions) (a stream grows past any table)."""
        if self.rope is None or self.rope.max_len < num_positions:
            self.init_rope(max(num_positions, 2 * (self.rope.max_len if self.rope else 0)))

    def rope_for(self, kind: str) -> Optional[RotaryEmbedding]:
        """The RoPE of the layers of this kind ("full" or "sliding"); None without RoPE."""
        return self.rope

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                recomputed: Optional[RecomputedLayers] = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]. With `recomputed`, its
        layers run over whole sequences first and the rest over the new rows of their output."""
        assert self.rope is not None, "call init_rope() after loading weights"
        layers = list(self.model.layers)
        if recomputed is None:
            x, residual = self.embed(input_ids), None
        else:
            x, residual = self.embed(recomputed.input_ids), None
            for layer in layers[:recomputed.num_layers]:
                x, residual = layer.forward(x, recomputed.positions, self.rope, recomputed.ctx, residual)
            x, residual = x[recomputed.new_rows], residual[recomputed.new_rows]
            layers = layers[recomputed.num_layers:]
        for layer in layers:
            x, residual = layer.forward(x, positions, self.rope, ctx, residual)
        return self.final_norm(x, residual)

    def final_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """The last layer's output added to the residual stream (None: x is the stream), normed."""
        return self.model.norm.add_forward(x, residual)[0] if residual is not None else self.model.norm(x)

    def fast_methods(self, env: FastPathEnv) -> Methods:
        """A step of plain decodes through every layer in one compiled call (layer_ops'
        DecodeStack: each layer's DecodeLayer in turn, the calls the layers' own loop makes, so
        the same hidden states bit for bit), where every layer runs as one call (decode_layer)
        over one cache group; any other step through the layers one by one."""
        ops = env.cpu_ops
        if (not (env.fused and env.stacked) or ops is None or not hasattr(ops, "DecodeStack")
                or type(self).forward is not LlamaForCausalLM.forward):
            return {}
        found = [getattr(layer.__dict__.get("forward"), "one_call", None) for layer in self.model.layers]
        parts: list[OneCallLayer] = [p for p in found if p is not None]
        if (not parts or len(parts) != len(found) or len({p.group for p in parts}) != 1
                or not all(ops.is_decode_layer(p.layer) for p in parts)):
            return {}
        stack = ops.DecodeStack([p.layer for p in parts])
        one_call, group, most = stack.forward, parts[0].group, min(p.rows for p in parts)
        layers_forward = LlamaForCausalLM.forward.__get__(self)

        @torch.inference_mode()
        def forward(input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                    recomputed: Optional[RecomputedLayers] = None) -> torch.Tensor:
            meta = ctx.metadata[group]
            if recomputed is not None or not meta.plain_decode or input_ids.shape[0] > most:
                return layers_forward(input_ids, positions, ctx, recomputed)
            assert self.rope is not None, "call init_rope() after loading weights"
            cos, sin = self.rope.angles(positions)
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            x, residual = one_call(self.embed(input_ids), cos, sin, meta.kv_write_plan, tables, lens,
                                   meta.sliding_window or 0)
            return self.final_norm(x, residual)
        return {"forward": forward}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first layer's input [T, hidden]."""
        return self.model.embed_tokens(input_ids)  # type: ignore[no-any-return]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in fp32, only for the rows that sample."""
        return self.lm_head(hidden).float()
