"""How many blocks the cache gets: from an explicit count, a byte budget, or a fraction of the
device's free memory. Sizes are counted exactly: K and V, every layer, every slot of a block,
and the null block the cache holds beside the pool's blocks.

With G cache groups the layers' tensors are shared across groups (tensor j holds the j-th layer
of each group), so a block holds layers / G layers and a sequence takes G blocks per block_size
tokens: the bytes per token are the model's either way."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from kvserve.config import CacheConfig, ModelConfig, OptionError
from kvserve.core.block_math import blocks_in_budget
from kvserve.core.cache_group import CacheGroupSpec, groups_of
from kvserve.kv.formats import KVFormat, check_format, kv_format

DEFAULT_CPU_BUDGET = 4 << 30  # like vLLM's CPU backend default KV space
DEFAULT_GPU_FRACTION = 0.9


@dataclass(frozen=True)
class CachePlan:
    block_size: int
    num_blocks: int
    block_bytes: int
    num_cpu_blocks: int
    kv_format: KVFormat
    num_residual_slots: int = 0  # int4: one open block per sequence, in the model's dtype
    residual_slot_bytes: int = 0
    fixed_bytes: int = 0  # fp8: the scales

    @property
    def total_bytes(self) -> int:
        """The cache's bytes: the pool's blocks, the null block, residual slots and scales."""
        return ((self.num_blocks + 1) * self.block_bytes + self.num_residual_slots * self.residual_slot_bytes
                + self.fixed_bytes)


def cache_groups(model: ModelConfig, cache: CacheConfig, max_model_len: int) -> tuple[CacheGroupSpec, ...]:
    """The model's layers grouped by how they attend: as its config says (full attention, or its
    own sliding window), or, with `cache.sliding_window`, every layer windowed (and with
    `cache.attention_sinks`, keeping the first tokens too). Impossible combinations are a
    ValueError naming the problem."""
    kinds, window, sinks = model.layer_kinds, model.sliding_window, cache.attention_sinks
    if cache.sliding_window is not None:
        if "sliding" in kinds and cache.sliding_window != model.sliding_window:
            raise ValueError(f"{model.name}'s config fixes which layers slide and their window "
                             f"({model.sliding_window} tokens); --sliding-window {cache.sliding_window} "
                             "cannot change it (it windows models whose layers all attend to every token)")
        if cache.sliding_window > max_model_len:
            raise ValueError(f"sliding window {cache.sliding_window} is larger than the context "
                             f"({max_model_len} tokens): positions in the cache would pass what the model knows")
        kinds, window = ("sliding",) * model.num_hidden_layers, cache.sliding_window
    if sinks:
        if "sliding" not in kinds:
            raise ValueError("--attention-sinks needs a sliding window to count within: "
                             "give --sliding-window W (the model has none of its own)")
        assert window is not None
        if sinks >= window:
            raise ValueError(f"attention sinks ({sinks}) must be fewer than the sliding window ({window})")
    return groups_of(kinds, window, sinks)


def cached_layers_config(model: ModelConfig, num_cached_layers: int) -> ModelConfig:
    """The model as its cache sees it when only num_cached_layers layers keep K/V (--cache-layers):
    every size the formats count (kvserve.kv.formats) is per layer, so the cache of such a model
    is the cache of one with that many layers (what only the model's layers need is left out)."""
    if num_cached_layers == model.num_hidden_layers:
        return model
    return dataclasses.replace(model, num_hidden_layers=num_cached_layers, layer_types=(), moe=None,
                               nope_layers=())


def is_bounded(groups: Sequence[CacheGroupSpec]) -> bool:
    """Whether every group holds a bounded number of blocks per sequence (no full attention)."""
    return all(g.window is not None for g in groups)


def free_device_memory(device: str) -> int:
    import torch
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read available memory from /proc/meminfo")


def plan_cache(cache: CacheConfig, model: ModelConfig, kv_cache_dtype: str, max_model_len: int,
               max_num_seqs: int, device: str, groups: Sequence[CacheGroupSpec] = (),
               model_dtype: str = "float32", step_tokens: int = 1) -> CachePlan:
    """num_blocks is the pool's; the cache holds one more (the null block), and a budget pays
    for it too, and for what the format keeps besides blocks (int4's residual slots, one per
    sequence; fp8's scales)."""
    fmt = kv_format(kv_cache_dtype, model_dtype)
    groups = tuple(groups) or (CacheGroupSpec("full", tuple(range(model.num_hidden_layers))),)
    num_groups = len(groups)
    block_size = max_model_len if cache.layout == "contiguous" else cache.block_size
    check_format(fmt, model, block_size, cache.layout)
    block_bytes = int(block_size * fmt.bytes_per_token(model, block_size)) // num_groups
    residual_slots = max_num_seqs if fmt.kind == "int4" else 0
    residual_slot_bytes = fmt.residual_bytes_per_sequence(model, block_size, model_dtype) // num_groups
    extra = residual_slots * residual_slot_bytes + fmt.fixed_bytes(model)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        if cache.memory_bytes is not None:
            budget = cache.memory_bytes
        elif cache.memory_fraction is not None:
            budget = int(free_device_memory(device) * cache.memory_fraction)
        elif device.startswith("cuda"):
            budget = int(free_device_memory(device) * DEFAULT_GPU_FRACTION)
        else:
            budget = min(DEFAULT_CPU_BUDGET, free_device_memory(device) // 4)
        num_blocks = blocks_in_budget(budget - extra, block_bytes) - 1  # the null block
        if num_blocks < 1:
            raise ValueError(f"a KV cache budget of {budget} bytes holds no block besides the null "
                             f"block ({block_bytes} bytes each); raise --kv-cache-memory")
        # more blocks than every seat filled to the context length can never be used at once
        # (a window group holds a step's tokens beyond its window: the step's tokens are shared)
        per_seq = sum(g.max_blocks_held(max_model_len, block_size) for g in groups)
        step_extra = sum(g.max_blocks_held(max_model_len, block_size, step_tokens) for g in groups) - per_seq
        num_blocks = min(num_blocks, max_num_seqs * per_seq + step_extra + 1)
    plan = CachePlan(block_size, num_blocks, block_bytes, blocks_in_budget(cache.swap_space_bytes, block_bytes),
                     fmt, residual_slots, residual_slot_bytes, fmt.fixed_bytes(model))
    check_fits(plan, cache, device)
    return plan


def check_fits(plan: CachePlan, cache: CacheConfig, device: str) -> None:
    """A cache sized by hand (--num-blocks, --kv-cache-memory in bytes) that the device cannot
    hold is refused before anything is allocated, saying what it would take: the allocation
    itself would fail with a traceback, or (memory the OS grants lazily) kill the process later."""
    option = "num_blocks" if cache.num_blocks is not None else "kv_cache_memory" if cache.memory_bytes else None
    if option is None:  # sized from the free memory itself
        return
    try:
        available = free_device_memory(device)
    except (RuntimeError, OSError):  # no /proc/meminfo: the allocation will tell
        return
    if plan.total_bytes > available:
        given = cache.num_blocks if cache.num_blocks is not None else cache.memory_bytes
        raise OptionError(option, f"{given}: the KV cache would need {plan.total_bytes:,} bytes "
                                  f"({_gib(plan.total_bytes)}), more than the {_gib(available)} of memory "
                                  f"available on {device}")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):,.1f} GiB"


@dataclass(frozen=True)
class WeightCount:
    """A model's parameters, and those one decode token multiplies by: every layer's matrices
    but, in a mixture-of-experts layer, only the router, the num_experts_per_tok experts it
    picks and the shared expert; the embedding table is one row (a tied head reads it whole)."""

    total: int
    per_token: int

    def bytes(self, bytes_per_param: float) -> tuple[int, int]:
        """(total, per decode token) in bytes at this many bytes per parameter."""
        return int(self.total * bytes_per_param), int(self.per_token * bytes_per_param)


def weight_params(model: ModelConfig) -> WeightCount:
    """The parameters of the model's matrices and norms (biases left out: a few per row).
    Example: Mixtral-8x7B, 46.7B in all, 12.7B read per token (2 of 8 experts; the embedding
    table aside, which the published 12.9B counts)."""
    H, V = model.hidden_size, model.vocab_size
    head = 0 if model.tie_word_embeddings else V * H
    total, per_token = V * H + head + H, H + V * H  # embedding, head, final norm; one embedding row + the head
    for i in range(model.num_hidden_layers):
        attn = _attention_params(model) + 2 * H
        mlp_total, mlp_active = _mlp_params(model, i)
        total, per_token = total + attn + mlp_total, per_token + attn + mlp_active
    return WeightCount(total, per_token)


def _attention_params(model: ModelConfig) -> int:
    H, heads = model.hidden_size, model.num_attention_heads
    m = getattr(model, "mla", None)
    if m is None:
        return 2 * H * heads * model.head_dim + 2 * H * model.num_key_value_heads * model.head_dim
    q_dim = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q = H * q_dim if m.q_lora_rank is None else H * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * q_dim
    kv = H * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + heads * m.v_head_dim * H


def _mlp_params(model: ModelConfig, layer_idx: int) -> tuple[int, int]:
    """(all, read per token) of one layer's MLP."""
    H, moe = model.hidden_size, model.moe
    if moe is None or not moe.is_sparse(layer_idx):
        return 3 * H * model.intermediate_size, 3 * H * model.intermediate_size
    expert, shared = 3 * H * moe.moe_intermediate_size, 3 * H * moe.shared_expert_intermediate_size
    fixed = moe.num_experts * H + shared + (H if moe.shared_expert_gate else 0)  # router, shared expert
    return fixed + moe.num_experts * expert, fixed + moe.num_experts_per_tok * expert
