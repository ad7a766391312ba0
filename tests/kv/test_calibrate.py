"""fp8 scales from observed K/V: the largest |K| and |V| per layer and KV head over every
observation, times the headroom, on the format's largest value (the pass that observes them is
kvserve.engine.calibrate's, tested through the engine in tests/engine/test_quantized_cache.py)."""

import torch

from kvserve.kv.calibrate import HEADROOM, MIN_SCALE, KVRange
from kvserve.kv.quant import FP8_DTYPES


def test_range_keeps_the_largest_magnitude_per_layer_and_head():
    r = KVRange(num_layers=2, num_kv_heads=2)
    k = torch.zeros(3, 2, 4)  # [tokens, kv_heads, head_dim]
    k[1, 0, 2] = -5.0
    v = torch.full((3, 2, 4), 0.5)
    r.observe(1, k, v)
    k2 = torch.zeros(1, 2, 4)
    k2[0, 0, 0], k2[0, 1, 3] = 3.0, 7.0  # head 0 smaller than before, head 1 larger
    r.observe(1, k2, torch.zeros(1, 2, 4))
    assert r.amax[1].tolist() == [[5.0, 7.0], [0.5, 0.5]]
    assert r.amax[0].tolist() == [[0.0, 0.0], [0.0, 0.0]]  # layer 0 never observed


def test_scales_put_headroom_times_the_largest_value_on_the_format_limit():
    r = KVRange(num_layers=1, num_kv_heads=2)
    r.observe(0, torch.tensor([[[4.0], [0.0]]]), torch.tensor([[[1.0], [2.0]]]))
    for fmt, dtype in FP8_DTYPES.items():
        limit = torch.finfo(dtype).max
        scales = r.fp8_scales(fmt)
        assert scales.shape == (1, 2, 2)
        assert torch.allclose(scales[0], torch.tensor([[4.0 * HEADROOM / limit, MIN_SCALE],
                                                       [1.0 * HEADROOM / limit, 2.0 * HEADROOM / limit]]))
