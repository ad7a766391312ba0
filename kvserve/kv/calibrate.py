"""fp8 KV scales: one per layer and KV head, for K and for V, fixed for the engine's life.

By default they are calibrated at start-up: the model reads a fixed English text (no cache),
the largest |K| and |V| of each layer and head are recorded, and the scale maps twice that onto
the format's largest value, so later values a little beyond the calibration still fit (beyond
that they saturate). Fixed scales keep every run's cache the same whatever the batch, so a
batched request gets the tokens it gets alone. Or they are given: a JSON file
{"k": S or [[per head] per layer], "v": ...} with S a number for all.
"""

from __future__ import annotations

import json
from typing import Optional

import torch

from kvserve.attention.backend import AttentionMetadata, PrefillSpan
from kvserve.attention.layer import ForwardContext, install
from kvserve.attention.torch_backend import TorchAttentionBackend
from kvserve.kv.quant import FP8_DTYPES
from kvserve.kv.storage import KVStorage
from kvserve.models.llama import LlamaForCausalLM
from kvserve.tokenizer.base import Tokenizer

HEADROOM = 2.0
CALIBRATION_TEXT = (
    "The history of the city begins with a small market by the river, where farmers traded grain, "
    "wool and salt. Over three centuries the market grew into a town with a cathedral, a university "
    "and a harbour crowded with ships from distant ports. Merchants kept careful accounts; scholars "
    "argued about astronomy, medicine and law; and every spring the streets filled with music for "
    "the festival of the new year. Today the old walls are a park, and visitors ask the same "
    "questions travellers always asked: where does the road lead, what does it cost, and how long "
    "will it take? def mean(xs): return sum(xs) / len(xs)  # 1, 2, 3 -> 2.0")


class _RecordingBackend(TorchAttentionBackend):
    """The torch path, noting the largest |K| and |V| of each layer and KV head."""

    def __init__(self, num_layers: int, num_kv_heads: int, dtype: torch.dtype) -> None:
        super().__init__(16, dtype)
        self.amax = torch.zeros(num_layers, 2, num_kv_heads)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                storage: Optional[KVStorage], meta: AttentionMetadata, scale: float,
                softcap: Optional[float] = None) -> torch.Tensor:
        for i, x in enumerate((k, v)):
            self.amax[layer, i] = torch.maximum(self.amax[layer, i], x.detach().float().abs().amax(dim=(0, 2)).cpu())
        return super().forward(layer, q, k, v, storage, meta, scale, softcap)


def calibrate_fp8(model: LlamaForCausalLM, tokenizer: Optional[Tokenizer], fmt: str) -> torch.Tensor:
    """Scales [layers, 2, kv_heads] from one pass over the calibration text."""
    c = model.config
    ids = tokenizer.encode(CALIBRATION_TEXT) if tokenizer is not None else list(range(min(c.vocab_size, 256)))
    ids = ids[:c.max_position_embeddings]
    device = model.device
    backend = _RecordingBackend(c.num_hidden_layers, c.num_key_value_heads, model.dtype)
    install(model, backend, [0] * c.num_hidden_layers)
    meta = backend.build_metadata(AttentionMetadata(prefills=[PrefillSpan(0, len(ids), len(ids))]), None)
    model.ensure_rope(len(ids))
    model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), ForwardContext(None, [meta]))
    limit = torch.finfo(FP8_DTYPES[fmt]).max
    return (backend.amax * HEADROOM / limit).clamp_min(1e-6)


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
