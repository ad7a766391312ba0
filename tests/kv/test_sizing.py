"""Cache sizing counts every byte it allocates, the null block included."""

import pytest

from kvserve.config import CacheConfig
from kvserve.core.cache_group import CacheGroupSpec, layer_maps
from kvserve.kv.sizing import plan_cache
from kvserve.models.registry import KNOWN_CONFIGS

SMOLLM2 = KNOWN_CONFIGS["smollm2-135m"]


def test_budget_pays_for_the_null_block():
    per_block = 16 * 46080
    plan = plan_cache(CacheConfig(memory_bytes=10 * per_block), SMOLLM2, "float32", 8192, 64, "cpu")
    assert plan.block_bytes == per_block and plan.num_blocks == 9
    assert plan.total_bytes == 10 * per_block  # nine for the pool, one null block
    with pytest.raises(ValueError, match="holds no block besides the null block"):
        plan_cache(CacheConfig(memory_bytes=per_block), SMOLLM2, "float32", 8192, 64, "cpu")


def test_explicit_block_count_is_the_pool():
    plan = plan_cache(CacheConfig(num_blocks=100), SMOLLM2, "bfloat16", 8192, 64, "cpu")
    assert plan.num_blocks == 100 and plan.block_bytes == 16 * 23040


def test_groups_split_the_layers_over_blocks():
    """Two groups: a block holds half the layers and a sequence takes twice the blocks, so a
    budget holds the same tokens."""
    one = plan_cache(CacheConfig(memory_bytes=1 << 26), SMOLLM2, "float32", 8192, 64, "cpu")
    two = plan_cache(CacheConfig(memory_bytes=1 << 26), SMOLLM2, "float32", 8192, 64, "cpu",
                     layer_maps_groups(2))
    assert two.block_bytes * 2 == one.block_bytes
    assert two.num_blocks + 1 == 2 * (one.num_blocks + 1)


def test_contiguous_layout_is_one_slab_per_block():
    plan = plan_cache(CacheConfig(layout="contiguous", memory_bytes=3 * 512 * 46080), SMOLLM2, "float32",
                      512, 64, "cpu")
    assert plan.block_size == 512 and plan.num_blocks == 2


def test_layer_maps_share_tensors_across_groups():
    groups = (CacheGroupSpec("full", (0, 2)), CacheGroupSpec("full", (1, 3)))
    assert layer_maps(groups, 4) == ((0, 1, 0, 1), (0, 0, 1, 1))
    with pytest.raises(ValueError, match="equally many layers"):
        layer_maps((CacheGroupSpec("full", (0,)), CacheGroupSpec("full", (1, 2))), 3)
    with pytest.raises(ValueError, match=r"layers \[2\] are in no cache group"):
        layer_maps((CacheGroupSpec("full", (0, 1)),), 3)


def layer_maps_groups(n):
    """SmolLM2's 30 layers cut into n full-attention groups."""
    return tuple(CacheGroupSpec("full", tuple(range(i, 30, n))) for i in range(n))
