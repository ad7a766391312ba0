"""fp8 KV scales: one per layer and KV head, for K and for V, fixed for the engine's life.

By default they are calibrated at start-up: the model reads a fixed English text (no cache; the
pass is kvserve.engine.calibrate's, which has a model to run), the largest |K| and |V| of each
layer and head are recorded (`KVRange`), and the scale maps twice that onto the format's
largest value, so later values a little beyond the calibration still fit (beyond that they
saturate). Fixed scales keep every run's cache the same whatever the batch, so a batched
request gets the tokens it gets alone. Or they are given: a JSON file
{"k": S or [[per head] per layer], "v": ...} with S a number for all.
"""

from __future__ import annotations

import json

import torch

from kvserve.kv.quant import FP8_DTYPES

HEADROOM = 2.0
MIN_SCALE = 1e-6  # a head that never moved still divides safely


class KVRange:
    """The largest |K| and |V| seen so far, per layer and KV head."""

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.amax = torch.zeros(num_layers, 2, num_kv_heads)  # [layers, K and V, kv_heads]

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [tokens, kv_heads, head_dim] of one layer."""
        for i, x in enumerate((k, v)):
            self.amax[layer, i] = torch.maximum(self.amax[layer, i], x.detach().float().abs().amax(dim=(0, 2)).cpu())

    def fp8_scales(self, fmt: str) -> torch.Tensor:
        """Scales [layers, 2, kv_heads] that put HEADROOM times the largest value seen on the
        largest value of fp8 format `fmt`."""
        limit = torch.finfo(FP8_DTYPES[fmt]).max
        return (self.amax * HEADROOM / limit).clamp_min(MIN_SCALE)


def read_fp8_scales(path: str, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """Scales [layers, 2, kv_heads] from a JSON file; a ValueError names what is wrong with it."""
    try:
        with open(path) as f:
            data = json.load(f)
        scales = torch.stack([torch.as_tensor(data[name], dtype=torch.float32).expand(num_layers, num_kv_heads)
                              for name in ("k", "v")], dim=1)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        raise ValueError(f"kv cache scales {path!r}: expected {{\"k\": S or [[per head] per layer], "
                         f"\"v\": ...}} for {num_layers} layers and {num_kv_heads} KV heads ({e})") from e
    if not bool((scales > 0).all()) or not bool(torch.isfinite(scales).all()):
        raise ValueError(f"kv cache scales {path!r}: every scale must be a positive finite number")
    return scales
