"""The CPU kernel backend: decodes through the compiled kernel
(kvserve/kernels/csrc/paged_attention.cpp), which reads each context's K/V blocks in place
through the block table, exactly its length (no gathered copy, no padding mask); chunks take
the torch path."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from kvserve import kernels
from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from kvserve.kv.storage import DenseKVStorage, KVStorage


def decode_fn(isa: Optional[str] = None) -> Optional[Callable[..., torch.Tensor]]:
    """The kernel at level `isa` (default: the best this CPU runs), or None where it cannot be
    built or compiled kernels are turned off."""
    module: Any = kernels.load("paged_attention", isa)
    return None if module is None else module.paged_decode


def failure() -> Optional[str]:
    return kernels.failure("paged_attention")


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu-kernel"

    def __init__(self, block_size: int, dtype: torch.dtype, decode: Callable[..., torch.Tensor]) -> None:
        super().__init__(block_size, dtype)
        self.paged_decode = decode

    @staticmethod
    def supports(storage: Optional[KVStorage], device: torch.device, dtype: torch.dtype) -> bool:
        """CPU, and a dense cache in the model's dtype."""
        return device.type == "cpu" and isinstance(storage, DenseKVStorage) and storage.dtype == dtype

    def _decode_mask(self, meta: TorchAttentionMetadata) -> None:
        """The kernel reads each context's exact length: no padding mask to build."""

    def decode(self, layer: int, q: torch.Tensor, storage: KVStorage, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        t = storage.layer_tensors(layer)
        return self.paged_decode(q.contiguous(), t["k"], t["v"], meta.decode_block_tables,
                                 meta.decode_context_lens, scale)
