"""What every loader returns, and the helpers they share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvserve.config import ModelConfig
from kvserve.tokenizer.base import Tokenizer


class ModelLoadError(ValueError):
    """A model path, file or format that cannot be loaded; the message names the problem."""


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face names, half-rotation RoPE layout
    tokenizer: Optional[Tokenizer]
    model_id: str  # names the weights in prefix-cache keys


def interleaved_to_half_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder Q/K projection rows from interleaved-pair RoPE (Meta, llama2.c, GGUF) to the
    half-split layout Hugging Face rotates: per head, rows (0,1),(2,3).. become 0..d/2 | d/2..d."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
