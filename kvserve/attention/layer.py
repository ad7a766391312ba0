"""Attention as a model sees it: a module per layer that hands q, k, v to the engine's backend
with its cache group's metadata. The runner installs the backend and each layer's group once
(`install`); a model file never knows which backend or cache layout it runs on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, LayerDecode
from kvserve.kv.storage import KVStorage
from kvserve.modules import DirectCall, FastPath, FastPathEnv, runs_fast_form_of, unbind_fast_path


@dataclass
class ForwardContext:
    """What one forward pass attends through: the cache, and the step's metadata per cache group."""

    storage: Optional[KVStorage]
    metadata: Sequence[AttentionMetadata]


class Attention(DirectCall, FastPath, nn.Module):
    def __init__(self, layer_idx: int, scale: float, softcap: Optional[float] = None) -> None:
        super().__init__()
        self.layer_idx, self.scale, self.softcap = layer_idx, scale, softcap
        self.backend: Optional[AttentionBackend] = None
        self.group = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q [T, heads, hd], k/v [T, kv_heads, hd] (after RoPE) -> [T, heads, hd]."""
        assert self.backend is not None, "the runner installs an attention backend before a forward pass"
        return self.backend.forward(self.layer_idx, q, k, v, ctx.storage, ctx.metadata[self.group], self.scale,
                                    self.softcap)

    def fast_methods(self, env: FastPathEnv) -> dict[str, Callable[..., torch.Tensor]]:
        """The backend's fast form of this layer, where it has one (it owns its kernels)."""
        if self.backend is None:
            return {}
        fast = self.backend.fast_forward(self.layer_idx, self.group, self.scale, self.softcap, env.storage)
        return {} if fast is None else {"forward": fast}

    def layer_decode(self, env: FastPathEnv) -> Optional[LayerDecode]:
        """The backend's plain decode of this layer as compiled operations (AttentionBackend.
        layer_decode), where the layer runs this class's fast form: its backend's fast_forward."""
        if self.backend is None or not runs_fast_form_of(self, Attention, ("forward",)):
            return None
        return self.backend.layer_decode(self.layer_idx, self.scale, self.softcap, env.storage)


def install(model: nn.Module, backend: AttentionBackend, layer_group: Sequence[int]) -> None:
    """Give every attention layer of the model the backend and its cache group. A model bound to
    an earlier backend's fast forms (kvserve.modules) goes back to its eager modules, which call
    the new one, until the runner binds it again."""
    unbind_fast_path(model)
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend, m.group = backend, layer_group[m.layer_idx]
