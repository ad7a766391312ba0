"""The CPU kernel backend: decodes through the compiled kernel
(kvserve/kernels/csrc/paged_attention.cpp), which reads each context's K/V blocks in place
through the block table, exactly its length (no gathered copy, no padding mask), dequantizing
quantized blocks (int8, fp8, int4) one block at a time in registers; chunks take the torch path."""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvserve import kernels
from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from kvserve.kv.storage import KVStorage


def kernel_module(isa: Optional[str] = None) -> Optional[Any]:
    """The kernel at level `isa` (default: the best this CPU runs), or None where it cannot be
    built or compiled kernels are turned off."""
    return kernels.load("paged_attention", isa)


def failure() -> Optional[str]:
    return kernels.failure("paged_attention")


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu-kernel"

    def __init__(self, block_size: int, dtype: torch.dtype, module: Any) -> None:
        super().__init__(block_size, dtype)
        self.module = module

    @staticmethod
    def supports(storage: Optional[KVStorage], device: torch.device, dtype: torch.dtype) -> bool:
        """A paged cache on CPU, in any format (the kernel reads each format's blocks itself)."""
        return device.type == "cpu" and storage is not None

    def _decode_mask(self, meta: TorchAttentionMetadata) -> None:
        """The kernel reads each context's exact length: no padding mask to build (groups with
        attention sinks decode through the torch path: the kernel scores every key from one query)."""
        if meta.sinks:
            super()._decode_mask(meta)

    def decode(self, layer: int, q: torch.Tensor, storage: KVStorage, meta: AttentionMetadata,
               scale: float, softcap: Optional[float] = None, q_sink: Optional[torch.Tensor] = None) -> torch.Tensor:
        if meta.sinks:
            return super().decode(layer, q, storage, meta, scale, softcap, q_sink)
        assert softcap is None, "the kernel does not soft-cap scores: such models take the torch backend"
        entry, operands = storage.decode_operands(layer)
        return getattr(self.module, entry)(q.contiguous(), *operands, meta.decode_block_tables,
                                           meta.decode_context_lens, scale, meta.sliding_window or 0)
