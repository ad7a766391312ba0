"""nn.Linear whose few-row bf16 products on CPU can go to a compiled kernel.

At decode time a linear layer multiplies a handful of rows by its whole weight, so its cost is
reading the weight once. PyTorch's stock bf16 GEMM on CPU reads it at about half the speed it
reads fp32 (SmolLM2: 26 ms for the 269 MB of bf16 weights vs 23 ms for the 538 MB of fp32), so
bf16 decode was slower than fp32 despite half the bytes. kernels/csrc/linear_bf16.cpp streams each
weight row once at memory bandwidth (13.5 ms for the same weights, AVX512-BF16); from 5 rows on,
the GEMM (AMX) is as fast or faster and takes over. Parameter names and results are those of nn.Linear:
the kernel sums bf16 products in fp32 and rounds once, as the GEMM does.

bf16 and fp32 products go to oneDNN with the weight reordered into its blocked layout once at load
(`use_onednn`) instead of at every call. bf16: the stock F.linear calls the same oneDNN GEMM, so
the products are the same bit for bit, and on SmolLM2's layers take 22% less time at 64 rows, 44%
at 16, and as long as the few-row kernel at 1-8 (2 threads, AVX512-BF16). fp32: the stock product
is MKL's, which sums in another order (results within float rounding of it); offline throughput
at 32 sequences rose 20-35%. The reordered weight replaces the plain one, so weights take no more
memory; a weight another module shares (a head tied to the embedding) stays plain.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.config import env_kernel_mode
from kvserve.modules import DirectCall

FEW_ROWS = 4  # the kernel's side of the measured crossover (it handles up to 8)

LinearFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


class Linear(DirectCall, nn.Linear):
    few_row_kernel: Optional[LinearFn] = None  # set per model by use_few_row_kernel()
    onednn_weight: Optional[torch.Tensor] = None  # set per model by use_onednn(): the weight, reordered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn_weight is not None:
            if x.dim() == 2:
                return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias, "none", [], "")
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.onednn_weight, self.bias,
                                                   "none", [], "")
            return y.reshape(*x.shape[:-1], self.out_features)
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
    """The few-row kernel `--linear-backend` asks for. auto takes the kernel where its AVX512-BF16 path runs
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


def onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's prepacked linear (CPU builds with mkldnn)."""
    try:
        return torch.backends.mkldnn.is_available() and all(
            hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bf16 products on this CPU: it needs AVX512 (BW, VL, DQ) or
    AVX-NE-CONVERT and refuses to reorder a bf16 weight elsewhere (AVX2-only machines)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes use_onednn reorders on this CPU: fp32 always, bf16 where oneDNN runs it
    (elsewhere the stock F.linear computes bf16 products its own way)."""
    return (torch.bfloat16, torch.float32) if onednn_bf16_supported() else (torch.float32,)


ONEDNN_BATCH_HINT = 64  # the row count oneDNN picks its blocked layout for (any count runs)


def use_onednn(model: nn.Module) -> int:
    """Reorder the weight of every fp32 CPU Linear (and bf16, where oneDNN runs bf16 on this CPU)
    that owns its weight into oneDNN's blocked layout, once, in place of the plain one. Returns how
    many were reordered."""
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    dtypes = onednn_dtypes()
    done = 0
    for m in model.modules():
        w = m.weight if isinstance(m, Linear) else None
        if (w is None or m.onednn_weight is not None or w.dtype not in dtypes or w.device.type != "cpu"
                or id(w) in shared):
            continue
        m.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), ONEDNN_BATCH_HINT)
        m.weight = nn.Parameter(w.new_empty(0), requires_grad=False)  # released: the reordered copy is the weight
        done += 1
    return done


def use_few_row_kernel(model: nn.Module, fn: Optional[LinearFn]) -> None:
    for m in model.modules():
        if isinstance(m, Linear):
            m.few_row_kernel = fn
