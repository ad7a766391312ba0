"""nn.Linear whose few-row bf16 products on CPU can go to a compiled kernel.

At decode time a linear layer multiplies a handful of rows by its whole weight, so its cost is
reading the weight once. PyTorch's stock bf16 GEMM on CPU reads it at about half the speed it
reads fp32 (SmolLM2: 26 ms for the 269 MB of bf16 weights vs 23 ms for the 538 MB of fp32), so
bf16 decode was slower than fp32 despite half the bytes. kernels/csrc/linear_bf16.cpp streams each
weight row once at memory bandwidth (13.5 ms for the same weights, AVX512-BF16); from 5 rows on,
the GEMM (AMX) is as fast or faster and takes over. Parameter names and results are those of nn.Linear:
the kernel sums bf16 products in fp32 and rounds once, as the GEMM does.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.config import env_kernel_mode
from kvserve.models.direct import DirectCall

FEW_ROWS = 4  # the kernel's side of the measured crossover (it handles up to 8)

LinearFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


class Linear(DirectCall, nn.Linear):
    few_row_kernel: Optional[LinearFn] = None  # set per model by use_few_row_kernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.few_row_kernel is not None and x.dim() == 2 and x.shape[0] <= FEW_ROWS
                and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and x.device.type == "cpu"):
            return self.few_row_kernel(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def few_row_bf16_kernel(isa: Optional[str] = None) -> Optional[LinearFn]:
    """The compiled kernel at level `isa` (default: the best this CPU runs), or None where it
    cannot be built or compiled kernels are turned off."""
    module = kernels.load("linear_bf16", isa)
    return None if module is None else module.linear_bf16


def kernel_for(backend: str) -> Optional[LinearFn]:
    """What `--linear-backend` asks for. auto takes the kernel where its AVX512-BF16 path runs
    (its portable path is slower than the stock GEMM, so auto takes it only when KVSERVE_KERNELS
    holds every kernel to its portable path); cpu-kernel takes it whatever its path, or fails."""
    if backend == "torch":
        return None
    fn = few_row_bf16_kernel()
    if fn is None and backend == "cpu-kernel":
        raise ValueError(f"linear backend 'cpu-kernel' is unavailable: {kernels.failure('linear_bf16')}")
    if backend == "auto" and kernels.best_isa("linear_bf16") == "portable" and env_kernel_mode() != "portable":
        return None
    return fn


def use_few_row_kernel(model: nn.Module, fn: Optional[LinearFn]) -> None:
    for m in model.modules():
        if isinstance(m, Linear):
            m.few_row_kernel = fn
