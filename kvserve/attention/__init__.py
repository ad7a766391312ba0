"""Attention backends behind one interface (backend.py), chosen once per engine:

  torch       PyTorch SDPA over gathered blocks: any device, any storage; the reference
  cpu-kernel  the compiled CPU decode kernel reading blocks in place; causal prompt chunks through
              the compiled chunk kernel (cpu_kernel.chunk_kernel), the others as torch
  auto        cpu-kernel on CPU where it builds, else torch
"""

from __future__ import annotations

from typing import Optional

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.kv.storage import KVStorage

BACKENDS = ("torch", "cpu-kernel")


def select(name: str, storage: Optional[KVStorage], device: torch.device, block_size: int,
           dtype: torch.dtype) -> AttentionBackend:
    """The backend `--attention-backend` names; auto takes the fastest that runs here.
    Asking for one that cannot run here is a ValueError naming why."""
    from kvserve.attention import cpu_kernel
    from kvserve.attention.torch_backend import TorchAttentionBackend
    supported = cpu_kernel.CpuKernelAttentionBackend.supports(storage, device, dtype)
    if name == "torch" or (name == "auto" and not supported):
        return TorchAttentionBackend(block_size, dtype)
    if name not in ("auto", "cpu-kernel"):
        raise ValueError(f"unknown attention backend {name!r}; choose auto or one of {BACKENDS}")
    if not supported:
        kind = f", not {storage.kind!r} blocks (they decode through torch)" if storage is not None else ""
        raise ValueError(f"attention backend 'cpu-kernel' runs on CPU, over a paged cache of its formats{kind}")
    module = cpu_kernel.kernel_module(storage=storage)
    if module is None:
        if name == "cpu-kernel":
            raise ValueError(f"attention backend 'cpu-kernel' could not be built: {cpu_kernel.failure(storage)}")
        return TorchAttentionBackend(block_size, dtype)
    from kvserve.kernels import cpu_flags
    chunks = cpu_kernel.chunk_kernel(cpu_flags())
    return cpu_kernel.CpuKernelAttentionBackend(block_size, dtype, module, chunks)
