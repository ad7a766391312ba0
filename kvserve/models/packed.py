"""Weights kept in GGUF's block formats (Q8_0, Q4_0, Q4_1): 32 weights a block with an fp16
scale (and for Q4_1 an fp16 minimum), 8.5, 4.5 and 5 bits a weight, instead of 32 or 16; and
the other common GGUF types (Q5_0, Q5_1, IQ4_NL: 32 weights a block; the K-quants Q2_K to Q6_K:
256 a block in groups of 16 or 32 with their own 4- to 8-bit scales, 2.6 to 6.6 bits a weight),
whose products and dequantization are kernels/csrc/linear_kquant.cpp's (each format names its
kernel).

Decode is bound by reading the weights, so `PackedLinear` multiplies a few rows of activations
by the packed weight directly (kernels/csrc/linear_quant.cpp: each row of W streamed once and
dequantized in registers); for many rows (prefill, big batches) it dequantizes the weight to the
activations' dtype and runs the dense GEMM, whose cost then dominates. `PackedEmbedding` looks
up packed rows and dequantizes only those. Both give what dequantizing the whole weight to fp32
and multiplying gives, up to the order of the sums.

With `--packed-activations int8`, `PackedLinearQ8` takes every product of Q4_0/Q4_1 weights
instead: the activations are quantized to 8 bits per block and multiplied in integer dot
products (kernels/csrc/linear_q8.cpp, llama.cpp's arithmetic), about twice as fast for few rows
and faster than the dense GEMM for many; the result is the float product with each activation
rounded to its block's step (`linear_q8_reference`). Weights of the other types take
`PackedLinearQ8Rows`: their GGUF rows as they are, the activations quantized per block of the
weight's size (256 for K-quants, as llama.cpp's Q8_K; `linear_int8_reference`).

Under an fp32 model, a checkpoint's fp16 and bf16 matrices (a GGUF's F16 and BF16) are kept as
they are, as the one-weight "blocks" of WIDE_FORMATS (`keep_wide`): half the bytes of the fp32
copy, read half as long by decode. Their kernel (kernels/csrc/linear_wide.cpp) widens each weight
to fp32 in registers, which is exact, so PackedLinear gives what the fp32 copy gives up to the
order of the sums; it stays faster than widening the weight and the fp32 GEMM up to 32 rows
(WIDE_ROWS), and beyond them the weight is widened per call.

`quantize` packs float weights (`--weight-dtype int8` -> Q8_0, `int4` -> Q4_1) the way llama.cpp's
reference quantizers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.models import kquants
from kvserve.modules import DirectCall, FastPath, FastPathEnv, KernelCall

BLOCK = 32  # weights a block of Q8_0 / Q4_0 / Q4_1 (and of Q5_0, Q5_1, IQ4_NL; K-quants have 256)
FEW_ROWS = 8  # up to this many rows the packed kernel; beyond, dequantize and the dense GEMM
WIDE_ROWS = 32  # the same for 16-bit weights (benchmarks/wide_weights.py: the kernel wins up to 32)


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block type: `block` weights in `block_bytes` bytes; `kernel` multiplies and
    dequantizes it, and takes products of up to `kernel_rows` rows (more: dequantize, GEMM)."""
    name: str
    ggml_type: int
    block_bytes: int
    block: int = BLOCK
    kernel: str = "linear_quant"
    kernel_rows: int = FEW_ROWS

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.block_bytes


FORMATS = {f.name: f for f in (
    BlockFormat("q8_0", 8, 34), BlockFormat("q4_0", 2, 18), BlockFormat("q4_1", 3, 20),
    BlockFormat("q5_0", 6, 22, kernel="linear_kquant"), BlockFormat("q5_1", 7, 24, kernel="linear_kquant"),
    BlockFormat("iq4_nl", 20, 18, kernel="linear_kquant"),
    BlockFormat("q2_k", 10, 84, 256, "linear_kquant"), BlockFormat("q3_k", 11, 110, 256, "linear_kquant"),
    BlockFormat("q4_k", 12, 144, 256, "linear_kquant"), BlockFormat("q5_k", 13, 176, 256, "linear_kquant"),
    BlockFormat("q6_k", 14, 210, 256, "linear_kquant"))}
BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS.values()}
# 16-bit floats as they are: a block of one weight in 2 bytes. Not among FORMATS: a GGUF's F16 and
# BF16 tensors load as float tensors, and only an fp32 model keeps them 16-bit (registry._weights).
WIDE_FORMATS = {torch.float16: BlockFormat("f16", 1, 2, 1, "linear_wide", WIDE_ROWS),
                torch.bfloat16: BlockFormat("bf16", 30, 2, 1, "linear_wide", WIDE_ROWS)}
WIDE_DTYPES = {f.name: dtype for dtype, f in WIDE_FORMATS.items()}


@dataclass
class PackedWeight:
    """A [N, K] weight as its packed rows: data uint8 [N, K / block * block bytes]."""
    fmt: BlockFormat
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        n, k = self.shape
        if k % self.fmt.block or tuple(self.data.shape) != (n, self.fmt.row_bytes(k)) or self.data.dtype != torch.uint8:
            raise ValueError(f"packed {self.fmt.name} weight {self.shape}: data {tuple(self.data.shape)} "
                             f"{self.data.dtype} does not hold it")

    def take_rows(self, index: torch.Tensor) -> "PackedWeight":
        return PackedWeight(self.fmt, self.data[index].contiguous(), (int(index.numel()), self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.fmt, self.shape[1], kernels.load(self.fmt.kernel))


def keep_wide(w: torch.Tensor) -> PackedWeight:
    """An fp16 or bf16 [N, K] weight as a PackedWeight over its own bytes, uint8 [N, 2 K]."""
    n, k = w.shape
    return PackedWeight(WIDE_FORMATS[w.dtype], w.detach().contiguous().view(torch.uint8), (n, k))


def dequantize(data: torch.Tensor, fmt: BlockFormat, k: int, kernel: Optional[Any],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows [N, row bytes] -> [N, k] in dtype (each weight computed in fp32, rounded once):
    the compiled kernel on CPU, straight into dtype; else torch."""
    if data.device.type == "cpu" and kernel is not None:
        return kernel.dequantize(data.contiguous(), fmt.ggml_type, k, str(dtype).removeprefix("torch."))  # type: ignore[no-any-return]
    return dequantize_torch(data, fmt, k).to(dtype)


def _half(b: torch.Tensor) -> torch.Tensor:
    """fp16 values from their two little-endian bytes [..., 2], as fp32."""
    return b.contiguous().view(torch.float16).float()


def dequantize_torch(data: torch.Tensor, fmt: BlockFormat, k: int) -> torch.Tensor:
    """Packed rows -> fp32 [N, k], as the gguf package computes each weight (bit for bit)."""
    n = data.shape[0]
    if fmt.name in WIDE_DTYPES:  # widening is exact
        return data.contiguous().view(WIDE_DTYPES[fmt.name]).float()
    if fmt.name in kquants.DECODERS:
        return kquants.dequantize(data.reshape(n, k // fmt.block, fmt.block_bytes), fmt.name).reshape(n, k)
    blocks = data.reshape(n, k // BLOCK, fmt.block_bytes)
    d = _half(blocks[..., 0:2])  # [n, nb, 1]
    if fmt.name == "q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, k)
    qs = blocks[..., -16:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # low nibbles: weights 0..15, high: 16..31
    if fmt.name == "q4_0":
        return (d * (q - 8)).reshape(n, k)
    return (d * q + _half(blocks[..., 2:4])).reshape(n, k)


def quantize(w: torch.Tensor, fmt: BlockFormat) -> PackedWeight:
    """Float [N, K] -> packed blocks: Q8_0 d = max|w| / 127, q = round(w / d); Q4_1 d =
    (max - min) / 15, m = min, q = round((w - m) / d); Q4_0 d = w of largest |w| / -8,
    q = clamp(round(w / d) + 8, 0, 15). The scales are stored as fp16, and q is computed
    from them as stored, so dequantizing gives back what the kernel multiplies by. Q5_0 and Q5_1
    are the gguf package's quantizers; the other types have none here (they come packed, from
    GGUF files)."""
    n, k = w.shape
    if fmt.name in kquants.DECODERS:
        return PackedWeight(fmt, kquants.quantize(w, fmt.name, fmt.ggml_type, fmt.block), (n, k))
    if k % BLOCK:
        raise ValueError(f"a {fmt.name} weight needs K divisible by {BLOCK}, got {k}")
    x = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    as_bytes = lambda t: t.to(torch.float16).unsqueeze(-1).view(torch.uint8)  # noqa: E731  [n, nb, 2]
    if fmt.name == "q8_0":
        d = (x.abs().amax(-1) / 127).to(torch.float16).float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(x * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        blocks = torch.cat([as_bytes(d), q], dim=-1)
    else:
        if fmt.name == "q4_1":
            lo, hi = x.amin(-1), x.amax(-1)
            d = ((hi - lo) / 15).to(torch.float16).float()
            m = lo.to(torch.float16).float()
            inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
            q = torch.round((x - m.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
            head = torch.cat([as_bytes(d), as_bytes(m)], dim=-1)
        else:
            idx = x.abs().argmax(-1, keepdim=True)
            d = (x.gather(-1, idx).squeeze(-1) / -8).to(torch.float16).float()
            inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
            q = (torch.round(x * inv.unsqueeze(-1)) + 8).clamp(0, 15).to(torch.uint8)
            head = as_bytes(d)
        blocks = torch.cat([head, q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    return PackedWeight(fmt, blocks.reshape(n, -1).contiguous(), (n, k))


def rows_forward(module: nn.Module, call: Optional[KernelCall]) -> dict[str, Callable[..., torch.Tensor]]:
    """The fast forward of a packed linear with this kernel call: fp32 rows it takes straight to
    it, anything else the module's eager forward ({} where there is no call)."""
    if call is None:
        return {}
    fn, operands, most, _ = call
    eager = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] <= most:
            return fn(x, *operands)
        return eager(module, x)  # type: ignore[no-any-return]
    return {"forward": forward}


class PackedLinear(DirectCall, FastPath, nn.Module):
    """nn.Linear over a packed weight (bias, if any, in the model's dtype)."""

    def __init__(self, packed: PackedWeight, bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.fmt = packed.fmt
        self.out_features, self.in_features = packed.shape
        self.register_buffer("qweight", packed.data, persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.kernel = kernels.load(packed.fmt.kernel)  # chosen once, not on every product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few = self._few_row_kernel(x)
        if few and x.dim() == 2 and x.shape[0] <= self.fmt.kernel_rows and x.dtype == torch.float32:
            return self._few_rows(x)  # decode's case, straight to the kernel (each torch op costs ~1 us)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if few and x2.shape[0] <= self.fmt.kernel_rows:
            y = self._few_rows(x2.float()).to(x.dtype)
        else:
            y = F.linear(x2, self._dense_weight(x.dtype), self.bias)
        return y.reshape(*lead, self.out_features)

    def kernel_call(self, env: FastPathEnv) -> Optional[KernelCall]:
        """The kernel that takes decode's few fp32 rows on env, its operands looked up once (a
        buffer read through nn.Module.__getattr__ costs about as much as the call); None: none."""
        if env.device.type != "cpu" or self.kernel is None:
            return None
        operands = (self.qweight, self.fmt.ggml_type, self.in_features, self.bias)
        return KernelCall(self.kernel.linear_quant, operands, self.fmt.kernel_rows, self)

    def rows_op(self, call: KernelCall) -> Any:
        """Its kernel call as one compiled operation (kvserve.modules.rows_op)."""
        return self.kernel.rows_op("linear_quant", *call.operands)

    def fast_methods(self, env: FastPathEnv) -> dict[str, Callable[..., torch.Tensor]]:
        """Decode's few fp32 rows straight to the kernel; the rest eager."""
        return rows_forward(self, self.kernel_call(env))

    def _few_row_kernel(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and self.kernel is not None

    def _few_rows(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [M <= kernel_rows, K] -> fp32 [M, N] through the compiled kernel."""
        return self.kernel.linear_quant(x, self.qweight, self.fmt.ggml_type, self.in_features, self.bias)  # type: ignore[no-any-return]

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.qweight, self.fmt, self.in_features, self.kernel, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"


class PackedLinearQ8(PackedLinear):
    """A Q4_0/Q4_1 PackedLinear whose products quantize the activations to 8 bits per 32-block
    and sum integer products (kernels/csrc/linear_q8.cpp), for one row or thousands, as
    llama.cpp does. Its rows are kept in that kernel's panels of 16 (GGUF's bytes, reordered
    once; `gguf_rows` gives them back)."""

    FORMATS = ("q4_0", "q4_1", "q8_0")

    def __init__(self, linear: PackedLinear) -> None:
        if linear.fmt.name not in self.FORMATS:
            raise ValueError(f"int8 activations multiply {self.FORMATS} weights, not {linear.fmt.name}")
        q8 = kernels.load("linear_q8")
        if q8 is None:
            raise ValueError(f"--packed-activations int8 needs the compiled linear_q8 kernel: {kernels.failure('linear_q8')}")
        if linear.qweight.device.type != "cpu":
            raise ValueError("--packed-activations int8 runs on CPU only")
        super().__init__(PackedWeight(linear.fmt, linear.qweight, (linear.out_features, linear.in_features)), linear.bias)
        self.qweight = q8.pack_panels(linear.qweight, linear.fmt.ggml_type, linear.in_features)
        self.q8 = q8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:
            return self._product(x)  # straight to the kernel (each torch op costs ~1 us)
        y = self._product(x.reshape(-1, self.in_features).float()).to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self.q8.linear_q8(x, self.qweight, self.fmt.ggml_type, self.in_features, self.out_features,  # type: ignore[no-any-return]
                                 self.bias)

    def kernel_call(self, env: FastPathEnv) -> Optional[KernelCall]:
        """linear_q8 takes fp32 rows of any count."""
        operands = (self.qweight, self.fmt.ggml_type, self.in_features, self.out_features, self.bias)
        return KernelCall(self.q8.linear_q8, operands, math.inf, self)

    def rows_op(self, call: KernelCall) -> Any:
        """Its kernel call as one compiled operation (kvserve.modules.rows_op)."""
        return self.q8.rows_op("linear_q8", *call.operands)

    def fast_methods(self, env: FastPathEnv) -> dict[str, Callable[..., torch.Tensor]]:
        """fp32 rows straight to the kernel; the rest eager."""
        return rows_forward(self, self.kernel_call(env))

    def gguf_rows(self, index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The weight's GGUF rows [N, row bytes], or those `index` names."""
        return self.q8.unpack_panels(self.qweight, self.fmt.ggml_type, self.in_features, self.out_features,  # type: ignore[no-any-return]
                                     index)

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.gguf_rows(), self.fmt, self.in_features, self.kernel, dtype)


class PackedLinearQ8Rows(PackedLinear):
    """A PackedLinear of the K-quants, Q5_0, Q5_1 or IQ4_NL whose products quantize the
    activations to 8 bits per block of the weight's size (256 weights for K-quants, as
    llama.cpp's Q8_K: fp32 d and sums per 16; 32 for the others) and sum integer products
    (kernels/csrc/linear_kquant.cpp), for one row or thousands. Its weight stays in GGUF's rows,
    so a tied embedding keeps reading the same table."""

    def __init__(self, linear: PackedLinear) -> None:
        if linear.fmt.kernel != "linear_kquant":
            raise ValueError(f"PackedLinearQ8Rows multiplies the linear_kquant formats, not {linear.fmt.name}")
        if linear.kernel is None:
            raise ValueError("--packed-activations int8 needs the compiled linear_kquant kernel: "
                             f"{kernels.failure('linear_kquant')}")
        if linear.qweight.device.type != "cpu":
            raise ValueError("--packed-activations int8 runs on CPU only")
        super().__init__(PackedWeight(linear.fmt, linear.qweight, (linear.out_features, linear.in_features)), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:
            return self._product(x)  # straight to the kernel (each torch op costs ~1 us)
        y = self._product(x.reshape(-1, self.in_features).float()).to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.linear_q8(x, self.qweight, self.fmt.ggml_type, self.in_features, self.bias)  # type: ignore[no-any-return]

    def kernel_call(self, env: FastPathEnv) -> Optional[KernelCall]:
        """linear_kquant's linear_q8 takes fp32 rows of any count."""
        operands = (self.qweight, self.fmt.ggml_type, self.in_features, self.bias)
        return KernelCall(self.kernel.linear_q8, operands, math.inf, self)

    def rows_op(self, call: KernelCall) -> Any:
        """Its kernel call as one compiled operation (kvserve.modules.rows_op)."""
        return self.kernel.rows_op("linear_q8", *call.operands)

    def fast_methods(self, env: FastPathEnv) -> dict[str, Callable[..., torch.Tensor]]:
        """fp32 rows straight to the kernel; the rest eager."""
        return rows_forward(self, self.kernel_call(env))


def use_int8_activations(model: nn.Module) -> None:
    """Give every packed linear of the model (fused ones too) int8 activations. A head tied to a
    packed embedding keeps one copy: the embedding then looks its rows up in the head's panels
    (Q4_0 / Q4_1 / Q8_0) or goes on reading the GGUF rows they share (the other types)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    tied = isinstance(embed, PackedEmbedding) and isinstance(head, PackedLinear) and head.qweight is embed.qweight
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if type(child) is PackedLinear and child.fmt.name in PackedLinearQ8.FORMATS:
                setattr(owner, name, PackedLinearQ8(child))
            elif type(child) is PackedLinear and child.fmt.kernel == "linear_kquant":
                setattr(owner, name, PackedLinearQ8Rows(child))
    if tied and isinstance(model.lm_head, PackedLinearQ8):
        model.model.embed_tokens = PanelEmbedding(model.lm_head, embed.dtype)  # type: ignore[union-attr,arg-type]


def linear_q8_reference(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """What PackedLinearQ8 computes, in torch (fp64 sums): x [M, K] rounded per 32-block to
    dx * round(x / dx) with dx = max|x| / 127, times the dequantized weight (GGUF order)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv)
    return (xq * dx).reshape(m, k).double() @ dequantize_torch(packed.data, packed.fmt, k).double().T


def linear_int8_reference(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """What PackedLinearQ8Rows computes, in torch (fp64 sums): x [M, K] rounded per block of the
    weight's size to dx * round(x / dx), dx = max|x| / 127, times the dequantized weight."""
    m, k = x.shape
    block = packed.fmt.block
    xb = x.float().reshape(m, k // block, block)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    return (torch.round(xb * inv) * dx).reshape(m, k).double() @ dequantize_torch(packed.data, packed.fmt, k).double().T


class PackedEmbedding(DirectCall, nn.Module):
    """nn.Embedding over a packed table: the looked-up rows are dequantized, to `dtype`."""

    def __init__(self, packed: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.fmt, self.dtype = packed.fmt, dtype
        self.num_embeddings, self.embedding_dim = packed.shape
        self.register_buffer("qweight", packed.data, persistent=False)
        self.kernel = kernels.load(packed.fmt.kernel)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids.reshape(-1)]
        return dequantize(rows, self.fmt, self.embedding_dim, self.kernel, self.dtype).reshape(*ids.shape, self.embedding_dim)


class PanelEmbedding(DirectCall, nn.Module):
    """An embedding over a PackedLinearQ8's panels (a tied head's): the looked-up rows are taken
    out of the panels in GGUF's order and dequantized, to `dtype`; no second copy of the table."""

    def __init__(self, table: PackedLinearQ8, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = [table]  # not a submodule: the model holds it as its head
        self.fmt, self.dtype = table.fmt, dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.table[0]
        rows = table.gguf_rows(ids.reshape(-1))
        return dequantize(rows, self.fmt, self.embedding_dim, table.kernel, self.dtype).reshape(*ids.shape, self.embedding_dim)


class SharedProduct:
    """A fused group's product while its parts take their columns: the input it was made from,
    the product and how many parts are still to take theirs. A plain object: tensors (or None)
    assigned to an nn.Module's attributes go through Module.__setattr__, 17 us for a group of
    three parts against 0.9 here (a stand-in's product calls, from Python); a decode step of
    Gemma-3-270M made 72 such assignments (Module.__setattr__ calls, in 27 calls of `product`:
    cProfile)."""

    __slots__ = ("input", "output", "left")

    def __init__(self) -> None:
        self.input: Optional[torch.Tensor] = None
        self.output: Optional[torch.Tensor] = None
        self.left = 0


class FusedPacked(nn.Module):
    """Several packed linears that read the same input (q, k and v; gate and up), multiplied as
    one: their rows concatenated, the input streamed through the kernel once, one call instead
    of several. The originals become `FusedPart`s taking their columns of the shared product;
    the first part computes it, the last one lets it go."""

    def __init__(self, parts: list[PackedLinear]) -> None:
        super().__init__()
        self.fused = PackedLinear(PackedWeight(parts[0].fmt, torch.cat([p.qweight for p in parts]),
                                               (sum(p.out_features for p in parts), parts[0].in_features)),
                                  torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None)
        self.sizes = [p.out_features for p in parts]
        self._shared = SharedProduct()

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every part's output at once (views of one product): what a layer that knows it holds
        the group calls instead of each part."""
        return self.fused(x).split_with_sizes(self.sizes, dim=-1)  # type: ignore[no-any-return]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        shared = self._shared
        if shared.input is not x or shared.left == 0:
            shared.input, shared.output, shared.left = x, self.fused(x), len(self.sizes)
        out = shared.output
        shared.left -= 1
        if shared.left == 0:
            shared.input = shared.output = None
        assert out is not None
        return out


class FusedPart(nn.Module):
    def __init__(self, group: FusedPacked, start: int, end: int) -> None:
        super().__init__()
        self.group = [group]  # not a submodule: the layer holds the group once
        self.start, self.end = start, end
        self.in_features, self.out_features = group.fused.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group[0].product(x)[..., self.start:self.end]


def fuse(owner: nn.Module, names: list[str], into: str) -> None:
    """Fuse owner's packed linears `names` (same input, format and bias presence) in place, the
    group going to owner's attribute `into` (one the owner declares, as None)."""
    if getattr(owner, into, False) is not None:
        raise AttributeError(f"{type(owner).__name__} declares no {into!r} (None) to fuse {names} into")
    parts = [getattr(owner, n) for n in names]
    if not all(isinstance(p, PackedLinear) for p in parts) or len({(p.fmt, p.in_features, p.bias is None)
                                                                   for p in parts}) != 1:
        return
    group = FusedPacked(parts)
    setattr(owner, into, group)
    start = 0
    for n, p in zip(names, parts):
        setattr(owner, n, FusedPart(group, start, start + p.out_features))
        start += p.out_features
