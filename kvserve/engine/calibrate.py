"""fp8 calibration: one pass of the model over a fixed text, with an attention backend that
watches K and V on their way in.

The pass runs a model through an attention backend, so it lives above both; the arithmetic
(the largest |K| and |V| per layer and KV head, the scales made from them, and why) is
kvserve.kv.calibrate's.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvserve.attention.backend import AttentionMetadata, PrefillSpan
from kvserve.attention.layer import ForwardContext, install
from kvserve.attention.torch_backend import TorchAttentionBackend
from kvserve.kv.calibrate import KVRange
from kvserve.kv.storage import KVStorage
from kvserve.models.llama import LlamaForCausalLM
from kvserve.tokenizer.base import Tokenizer

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
        self.range = KVRange(num_layers, num_kv_heads)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                storage: Optional[KVStorage], meta: AttentionMetadata, scale: float,
                softcap: Optional[float] = None) -> torch.Tensor:
        self.range.observe(layer, k, v)
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
    return backend.range.fp8_scales(fmt)
