"""How many blocks the cache gets: from an explicit count, a byte budget, or a fraction of the
device's free memory. Sizes are counted exactly: K and V, every layer, every slot of a block,
and the null block the cache holds beside the pool's blocks.

With G cache groups the layers' tensors are shared across groups (tensor j holds the j-th layer
of each group), so a block holds layers / G layers and a sequence takes G blocks per block_size
tokens: the bytes per token are the model's either way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvserve.config import CacheConfig, ModelConfig
from kvserve.core.block_math import blocks_in_budget
from kvserve.core.cache_group import CacheGroupSpec
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
               model_dtype: str = "float32") -> CachePlan:
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
        per_seq = sum(g.max_blocks_held(max_model_len, block_size) for g in groups)
        num_blocks = min(num_blocks, max_num_seqs * per_seq + 1)
    return CachePlan(block_size, num_blocks, block_bytes, blocks_in_budget(cache.swap_space_bytes, block_bytes),
                     fmt, residual_slots, residual_slot_bytes, fmt.fixed_bytes(model))
