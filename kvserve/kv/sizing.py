"""How many blocks the cache gets: from an explicit count, a byte budget, or a fraction of the
device's free memory. Sizes are counted exactly: K and V, every layer, every slot of a block,
and the null block the cache holds beside the pool's blocks.

With G cache groups the layers' tensors are shared across groups (tensor j holds the j-th layer
of each group), so a block holds layers / G layers and a sequence takes G blocks per block_size
tokens: the bytes per token are the model's either way."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import CacheConfig, ModelConfig
from kvserve.core.block_math import blocks_in_budget, num_blocks_for

DEFAULT_CPU_BUDGET = 4 << 30  # like vLLM's CPU backend default KV space
DEFAULT_GPU_FRACTION = 0.9


@dataclass(frozen=True)
class CachePlan:
    block_size: int
    num_blocks: int
    block_bytes: int
    num_cpu_blocks: int

    @property
    def total_bytes(self) -> int:
        """The cache's bytes: the pool's blocks and the null block."""
        return (self.num_blocks + 1) * self.block_bytes


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


def plan_cache(cache: CacheConfig, model: ModelConfig, kv_dtype: str, max_model_len: int,
               max_num_seqs: int, device: str, num_groups: int = 1) -> CachePlan:
    """num_blocks is the pool's; the cache holds one more (the null block), and a budget pays
    for it too."""
    block_size = max_model_len if cache.layout == "contiguous" else cache.block_size
    block_bytes = int(block_size * model.kv_bytes_per_token(kv_dtype)) // num_groups
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
        num_blocks = blocks_in_budget(budget, block_bytes) - 1  # the null block
        if num_blocks < 1:
            raise ValueError(f"a KV cache budget of {budget} bytes holds no block besides the null "
                             f"block ({block_bytes} bytes each); raise --kv-cache-memory")
        # more blocks than every seat filled to the context length can never be used at once
        num_blocks = min(num_blocks, max_num_seqs * num_groups * num_blocks_for(max_model_len, block_size) + 1)
    return CachePlan(block_size, num_blocks, block_bytes,
                     blocks_in_budget(cache.swap_space_bytes, block_bytes))
