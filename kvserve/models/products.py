"""Which product path packed weights take, as data: the policy, the kernels each path needs and
the formats a checkpoint packs.

A packed linear can multiply its rows of activations three ways:

    int8   the activations quantized to 8 bits a block and integer dot products
           (PackedLinearQ8 for Q4_0 / Q4_1 / Q8_0, PackedLinearQ8Rows for the K-quants and the
           other 32-blocks): the packed bytes read once, whatever the number of rows
    float  PackedLinear: fp32 activations; up to 8 rows the packed kernel, beyond it the weight
           dequantized to fp32 on every call and the dense GEMM (exact: --exact)
    dense  a dequantized bf16 or fp32 copy kept beside the packed weight and multiplied by
           oneDNN (AMX on CPUs that have it): 3.2x (bf16) to 6.4x (fp32) the bytes of Q4_1;
           with linear_q8's AMX build, the same bf16 product made in AMX tiles from the packed
           weight at each call (no copy)

`ProductPolicy` says, by the number of rows of a call, which one runs. The defaults
(`--packed-activations auto`) take the policy of the CPU's matrix unit (`default_policy`): with
AMX, int8 up to 64 rows for Q4_0 / Q4_1 / Q8_0 and 8 for the others, the bf16 dense path above
(`DenseAbove`, within a memory budget); with AVX512-BF16 and no AMX, int8 at every row count for
Q4_0 / Q4_1 / Q8_0 and the bf16 copy above 8 rows for the others; elsewhere int8 at every row
count. `--packed-activations int8` takes int8 for every row count and --exact float. The rules
are data in DEFAULT_POLICIES, chosen by benchmarks/product_paths.py (ProductPolicy's docstring
gives the figures).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from kvserve import kernels
from kvserve.config import BF16_CPU_FLAGS, DTYPE_BYTES
from kvserve.models.loaders.base import LoadedModel
from kvserve.models.packed import FORMATS, PackedLinear, PackedLinearQ8, PackedLinearQ8Rows, PackedWeight
from kvserve.modules import DirectCall, FastPath, FastPathEnv, KernelCall, has_rows_op

QUANTIZE_TO = {"int8": "q8_0", "int4": "q4_1"}  # --weight-dtype: the format float matrices are packed to
PATHS = ("int8", "float", "dense")


@dataclass(frozen=True)
class ProductPolicy:
    """The product path of a packed linear for a call of `rows` activation rows.

    activations: "int8" or "float", the path of every row count, except that above a row
    threshold (dense_above_rows: per int8 kernel, "linear_q8" for Q4_0 / Q4_1 / Q8_0 and
    "linear_kquant" for the others; a kernel not named: never) a dense copy of the weight in
    dense_dtype runs, where the CPU has the flags dense_needs (the copy is multiplied by oneDNN:
    AMX / AVX512-BF16) and the copy fits the memory budget (`dense_copy_budget`).

    Measured (benchmarks/product_paths.py, Intel Xeon with AMX-BF16, AVX512-BF16 and AVX512-VNNI,
    one thread's CPU time for one decoder layer's products, microseconds, the fastest of 15):

        SmolLM2-135M Q4_1      rows      1      4     16     64    256    512
          int8 (PackedLinearQ8)        198    282    554   1538   6269  12837
          float (dequantize per call)  745    905   4269   6348  14197  24139
          bf16 copy (oneDNN, AMX)      735    717   1133   1557   3335   6097
          fp32 copy (oneDNN)          1115   1134   1684   3409  10595  20089
        Gemma-3-270M Q4_K_M (Q5_0 q/k/v and gate/up, Q8_0, Q4_K, Q6_K)
          int8 (PackedLinearQ8Rows)   1127   1368   2935  11423  46124 109390
          float                        931   1335   8138  10792  21967  37134
          bf16 copy                   1286   1319   1498   2387   5242   9426
          fp32 copy                   2101   2062   2973   5552  16047  31304

    Q4_1: int8 is fastest up to 64 rows (tied with the bf16 copy at 64); above, the bf16 copy
    takes half the time. The K-quant / Q5_0 kernels: the three paths are within 20% of each other
    up to 4 rows, and from 16 rows the bf16 copy takes a half to a tenth of int8's time. So
    AMX_POLICY: int8 up to 64 rows (Q4_0 / Q4_1 / Q8_0) or 8 rows (the others), the bf16 dense
    path above, within the memory budget. Made in AMX tiles from Q4_0 / Q4_1 / Q8_0 weights
    (tiles_above_rows), the dense path runs above 24 rows: one step's 120 products of SmolLM2 at
    16 / 24 / 32 / 64 rows took 9.08 / 10.43 / 11.40 / 18.41 ms in tiles against 9.02 / 11.47 /
    12.40 / 24.30 int8 (2 threads, the int8 tiles on AMX-INT8 from 32 rows; product_paths.py
    --step-rows).

    Without AMX the bf16 copy is multiplied by AVX512-BF16's dot products, and int8's VNNI dot
    products are faster for Q4_0 / Q4_1 / Q8_0 at every row count (AMD EPYC Zen 4, AVX512-BF16
    and AVX512-VNNI, 2 threads, wall time on a quiet machine, the fastest of 15; product_paths.py
    --threads 2 --clock wall --no-engine):

        SmolLM2-135M Q4_1      rows      1      4     16     64    256    512
          int8                         136    173    387   1114   3314   6618
          bf16 copy (oneDNN)           502    418    866   1860   4872   9432
        Gemma-3-270M Q4_K_M
          int8                         351    490   1708   6098  24996  49281
          bf16 copy                    784    674   1278   2791   8545  16083

    So AVX512_BF16_POLICY: int8 at every row count for Q4_0 / Q4_1 / Q8_0 (no copies of them),
    the bf16 copy above 8 rows for the others. A CPU with neither keeps no copy (INT8_POLICY).
    """

    activations: str = "int8"
    dense_above_rows: tuple[tuple[str, int], ...] = ()  # (int8 kernel, rows), e.g. (("linear_q8", 64),)
    dense_dtype: str = "bfloat16"
    dense_needs: frozenset[str] = BF16_CPU_FLAGS
    # where the dense product is made in AMX tiles from the packed weight (no copy): its own rows
    tiles_above_rows: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.activations not in ("int8", "float"):
            raise ValueError(f"policy activations must be int8 or float, got {self.activations!r}")
        for field in ("dense_above_rows", "tiles_above_rows"):
            for kernel, rows in getattr(self, field):
                if rows < 0:
                    raise ValueError(f"{field} of {kernel} must be >= 0, got {rows}")

    def threshold(self, kernel: str, tiles: bool = False) -> Optional[int]:
        """The rows above which a weight of this int8 kernel takes the dense path (None: never):
        its copy, or with `tiles` the AMX tiles made from the packed weight where the policy
        names a row count for them (else the copy's)."""
        above = dict(self.dense_above_rows).get(kernel)
        return dict(self.tiles_above_rows).get(kernel, above) if tiles and above is not None else above

    def path(self, rows: int, kernel: str = "linear_q8", tiles: bool = False) -> str:
        """The path a call of `rows` rows takes for a weight of this int8 kernel: one of PATHS."""
        above = self.threshold(kernel, tiles)
        if above is not None and rows > above:
            return "dense"
        return self.activations

    def keeps_copies(self, cpu_flags: frozenset[str]) -> bool:
        """Whether a dense copy pays on a CPU with these flags (the policy has a dense path and the
        CPU multiplies its dtype natively)."""
        return bool(self.dense_above_rows) and bool(cpu_flags & self.dense_needs)


# The defaults on CPU (auto), by the CPU's matrix unit: the first whose dense_needs the CPU has
AMX_POLICY = ProductPolicy("int8", dense_above_rows=(("linear_q8", 64), ("linear_kquant", 8)),
                           dense_needs=frozenset({"amx_bf16"}), tiles_above_rows=(("linear_q8", 24),))
AVX512_BF16_POLICY = ProductPolicy("int8", dense_above_rows=(("linear_kquant", 8),),
                                   dense_needs=frozenset({"avx512_bf16"}))
DEFAULT_POLICIES = (AMX_POLICY, AVX512_BF16_POLICY)
INT8_POLICY = ProductPolicy("int8")  # --packed-activations int8: int8 for every row count
EXACT_POLICY = ProductPolicy("float")  # --exact, --packed-activations float
DENSE_COPY_EXPANSION = 4  # a copy holds at most 4x the packed bytes (bf16 of a 4-bit format: 3.2x)


def default_policy(cpu_flags: frozenset[str]) -> ProductPolicy:
    """The defaults' policy on a CPU with these flags: the first of DEFAULT_POLICIES whose dense
    path the CPU multiplies natively, else int8 at every row count."""
    return next((p for p in DEFAULT_POLICIES if p.keeps_copies(cpu_flags)), INT8_POLICY)


def policy_for(packed_activations: str, dense_copy_memory: float = 0.0,
               cpu_flags: Optional[frozenset[str]] = None) -> ProductPolicy:
    """The policy of a resolved --packed-activations (int8 or float) on this CPU (or one with
    `cpu_flags`); dense copies only where the defaults chose int8 (dense_copy_memory > 0)."""
    if packed_activations == "float":
        return EXACT_POLICY
    if dense_copy_memory <= 0:
        return INT8_POLICY
    return default_policy(kernels.cpu_flags() if cpu_flags is None else cpu_flags)


def dense_copy_budget(packed_bytes: int, fraction: float, available_bytes: int) -> int:
    """Bytes the dense copies may take: at most the packed bytes times DENSE_COPY_EXPANSION and
    never beyond `fraction` of the memory available. dense_copy_budget(66e6, 0.25, 1e9) == 250e6"""
    return int(min(packed_bytes * DENSE_COPY_EXPANSION, fraction * available_bytes))


def available_memory() -> int:
    """Bytes of memory the system has available (physical pages free), 0 where unknown."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class DenseAbove(DirectCall, FastPath, nn.Module):
    """A packed linear that takes `policy`'s path by the rows of each call: the int8 module it
    holds, or above the policy's row threshold a dense copy of the weight (the same GGUF weights
    dequantized once, reordered for oneDNN), the fp32 activations rounded to its dtype.

    The copy is made by the first call that needs it, not at load: about 1.5 s for SmolLM2's 210
    matrices, which a run that never multiplies more rows than the threshold (a short chat, a
    decode-only benchmark) never pays; `make_copy()` makes it ahead (a server before it listens)."""

    def __init__(self, packed: PackedLinear, policy: ProductPolicy) -> None:
        super().__init__()
        self.packed, self.policy = packed, policy
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.fmt = packed.fmt
        self.dense_dtype = getattr(torch, policy.dense_dtype)
        self.dense_weight: Optional[torch.Tensor] = None  # made by make_copy()
        self.dense_bias: Optional[torch.Tensor] = None
        self.tiles = bf16_tiles(packed, policy.dense_dtype)  # the copy's product without the copy
        self.dense_bytes = copy_bytes(packed, policy)
        self.kernel_name = int8_kernel(packed.fmt.name)
        above = policy.threshold(self.kernel_name, tiles=self.tiles is not None)
        self.threshold = above if above is not None else 1 << 62

    def make_copy(self) -> None:
        """The dense copy, once: each weight rounded once from fp32, reordered for oneDNN (none
        where the AMX tiles make it from the packed weight at each call)."""
        if self.dense_weight is None and self.tiles is None:
            w = self.packed._dense_weight(self.dense_dtype)  # [N, K]
            self.dense_weight = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            bias = self.packed.bias
            self.dense_bias = None if bias is None else bias.detach().to(self.dense_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.threshold:  # the policy's path for this many rows is not the dense one
            return self.packed(x)  # type: ignore[no-any-return]
        return self._dense(x2).to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            p = self.packed
            return self.tiles(x.float().contiguous(), p.qweight, p.fmt.ggml_type,  # type: ignore[no-any-return]
                              self.in_features, self.out_features, p.bias)
        self.make_copy()  # the first call above the threshold makes it
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dense_dtype), self.dense_weight,  # type: ignore[no-any-return]
                                                  self.dense_bias, "none", [], "")

    def kernel_call(self, env: FastPathEnv) -> Optional[KernelCall]:
        """The held module's kernel call, up to the threshold."""
        call = self.packed.kernel_call(env)
        return None if call is None else call._replace(rows=min(call.rows, self.threshold), module=self)

    def rows_op(self, call: KernelCall) -> Any:
        """The held module's compiled operation (kvserve.modules.rows_op): kernel_call is its call;
        None where the held module has none for it."""
        return self.packed.rows_op(call) if has_rows_op(self.packed) else None

    def fast_methods(self, env: FastPathEnv) -> dict[str, Callable[..., torch.Tensor]]:
        """The held module's kernel call up to the threshold (called here: one frame fewer than
        its forward), the dense product above it."""
        call = self.kernel_call(env)
        if call is None:
            return {}
        fn, operands, few, _ = call
        packed, threshold, dense, tiles = self.packed, self.threshold, self._dense, self.tiles
        # the tiles exist for a PackedLinearQ8 only (bf16_tiles) and take linear_q8's operands
        eager = type(self).forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 2 and x.dtype == torch.float32:
                rows = x.shape[0]
                if rows <= few:
                    return fn(x, *operands)  # type: ignore[no-any-return]
                if rows <= threshold:
                    return packed.forward(x)  # type: ignore[no-any-return]
                y = tiles(x, *operands) if tiles is not None else dense(x).float()
                return y  # type: ignore[no-any-return]
            return eager(self, x)
        return {"forward": forward}

    def extra_repr(self) -> str:
        if self.tiles is not None:
            return f"dense above {self.threshold} rows: bf16 tiles dequantized at each call (no copy)"
        made = "made" if self.dense_weight is not None else "made at first use"
        return f"dense above {self.threshold} rows: {self.policy.dense_dtype} copy of {self.dense_bytes} bytes ({made})"


def keep_dense_copies(model: nn.Module, policy: ProductPolicy, budget_bytes: int) -> int:
    """Wrap the model's int8 packed linears (not the head: it multiplies only the sampled rows)
    in DenseAbove, largest first while their copies fit budget_bytes. Returns the bytes kept."""
    head = getattr(model, "lm_head", None)
    found = [(owner, name, child) for owner in list(model.modules()) for name, child in owner.named_children()
             if type(child) in (PackedLinearQ8, PackedLinearQ8Rows) and child is not head
             and policy.threshold(int8_kernel(child.fmt.name)) is not None]
    kept = 0
    for owner, name, child in sorted(found, key=lambda f: -f[2].out_features * f[2].in_features):
        size = copy_bytes(child, policy)
        if kept + size <= budget_bytes:
            setattr(owner, name, DenseAbove(child, policy))
            kept += size
    return kept


def bf16_tiles(packed: PackedLinear, dense_dtype: str) -> Optional[Callable[..., torch.Tensor]]:
    """The AMX build's product of bf16 x by the weight dequantized to bf16 tile by tile at each
    call (linear_q8's `linear_bf16_tiles`): what a bf16 copy multiplies, up to the order of the
    fp32 sums, with no copy held. None where it is not built or the weight is not linear_q8's."""
    if dense_dtype != "bfloat16" or not isinstance(packed, PackedLinearQ8):
        return None
    return getattr(packed.q8, "linear_bf16_tiles", None)


def copy_bytes(packed: PackedLinear, policy: ProductPolicy) -> int:
    """The bytes a DenseAbove of this linear holds: its dense copy's, or none with bf16 tiles."""
    if bf16_tiles(packed, policy.dense_dtype) is not None:
        return 0
    return packed.out_features * packed.in_features * DTYPE_BYTES[policy.dense_dtype]


def make_dense_copies(model: nn.Module) -> int:
    """Make every DenseAbove's copy now (they are otherwise made by their first large call).
    Returns their bytes."""
    made = 0
    for m in model.modules():
        if isinstance(m, DenseAbove):
            m.make_copy()
            made += m.dense_bytes
    return made


def int8_kernel(fmt: str) -> str:
    """The compiled kernel that multiplies weights of format `fmt` by int8 activations."""
    return "linear_q8" if fmt in PackedLinearQ8.FORMATS else FORMATS[fmt].kernel


def missing_int8_kernels(formats: set[str]) -> list[str]:
    """The int8 kernels the formats need that do not load here (each named once, sorted)."""
    return sorted({int8_kernel(f) for f in formats if kernels.load(int8_kernel(f)) is None})


def packed_formats(loaded: LoadedModel, weight_dtype: str = "auto") -> set[str]:
    """The formats the model's packed matrices will have: the checkpoint's packed ones (kept with
    weight_dtype auto), or the format --weight-dtype int8 / int4 packs float matrices to."""
    if weight_dtype in QUANTIZE_TO:
        return {QUANTIZE_TO[weight_dtype]}
    if weight_dtype != "auto":
        return set()
    return {v.fmt.name for v in loaded.state_dict.values() if isinstance(v, PackedWeight)}
