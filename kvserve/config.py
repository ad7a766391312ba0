"""One config tree of frozen dataclasses, validated on construction.

Dtypes are named by strings ("float32", "bfloat16", ...) so this module and `core/` never import
torch. Environment variables are read here and nowhere else (`env_api_key`, `env_kernel_mode`,
`env_cxx`).

Every engine option is declared once, here, as a field made by `option(...)`: the field gives
its type and its default and `__post_init__` validates it; the option's metadata gives its help
and choices, and its flat name (as `LLM(...)` takes it), flag and conversion from what the flag
parses where they differ from the field's. `kvserve.engine.args` builds the command line's
flags and the flat options from these fields; nothing else writes a default down.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

# Bytes per element of the model dtypes. The KV cache's own formats (fp8, int8, int4 with their
# scales) are costed in kvserve.kv.formats.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
MODEL_DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_DTYPES = ("auto", *MODEL_DTYPES, "int8", "int4")
PACKED_ACTIVATIONS = ("auto", "float", "int8")  # what packed weights multiply by (auto: resolve_packed_activations)
# /proc/cpuinfo flags of a CPU that multiplies bf16 natively (kvserve.kernels.cpu_flags reads them)
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# What the large float matrices of a checkpoint are stored as: a float dtype, or "packed" (GGUF
# blocks: Q8_0, Q4_*, K-quants, ...); kvserve.models.registry.checkpoint_dtype tells which.
CHECKPOINT_DTYPES = (*MODEL_DTYPES, "packed")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
KV_CACHE_ALIASES = {**DTYPE_ALIASES, "fp8": "fp8_e4m3", "float8_e4m3": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
KERNEL_BACKENDS = ("auto", "torch", "cpu-kernel")  # attention_backend, linear_backend
KV_LAYOUTS = ("paged", "contiguous")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("auto", "recompute", "swap")  # auto: per victim, whichever its measured cost favours
EVICTION_POLICIES = ("lru", "fifo", "priority", "cost")  # kvserve.core.eviction
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # the model `LLM()` and the command line load unless told


class FieldError(ValueError):
    """A value a named field cannot take (a request's, an option's). The field travels as data
    (`field`), so a front end names it (the server's `param`) without reading the message, which
    starts with the field's name: 'tools: item 0 needs a function name'."""

    def __init__(self, field: str, problem: str, separator: str = ": ") -> None:
        super().__init__(f"{field}{separator}{problem}")
        self.field, self.problem = field, problem


class OptionError(FieldError):
    """A value an option cannot take. `option` is the option's name as `LLM(...)` and the
    options dataclasses take it; the command line spells it with dashes (num_blocks is
    --num-blocks), so each front end can name it as its user typed it."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(option, problem, " ")
        self.option = option

    @property
    def as_flag(self) -> str:
        """The message as the command line names the option: '--num-blocks must be >= 1, got 0'."""
        return f"--{self.option.replace('_', '-')} {self.problem}"


def check_at_least(option: str, value: Any, minimum: int, integer: bool = True) -> None:
    """OptionError unless value is a number >= minimum, and a whole one where `integer` (a bool
    is neither; NaN is never >= anything)."""
    is_number = isinstance(value, numbers.Integral if integer else numbers.Real) and not isinstance(value, bool)
    if not (is_number and value >= minimum):
        what = "an integer" if integer else "a number"
        raise OptionError(option, f"must be {what} >= {minimum}, got {value!r}")


def check_seconds(option: str, value: object) -> None:
    """A finite number of seconds >= 0 (the grace asyncio waits, a logging period)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise OptionError(option, f"must be a number of seconds >= 0, got {value!r}")


# (the option as its flag names it, the value the flag parsed) -> the option's value
FlagConversion = Callable[[str, Any], Any]


def option(default: Any, help: Optional[str] = None, *, name: Optional[str] = None,
           flags: tuple[str, ...] = (), choices: Optional[Sequence[str]] = None,
           metavar: Optional[str] = None, flag_type: Optional[type] = None,
           from_flag: Optional[FlagConversion] = None, nargs: Optional[str] = None) -> Any:
    """A config field that is an engine option, with its default; the rest is how front ends name it.

    name: its flat name, as `LLM(...)` takes it (default: the field's).
    flags: its command-line spellings (default: "--" and the flat name with dashes). A bool
        option's flag sets the opposite of its default (`--no-cache` sets use_cache False); two
        options may share one flag, the first declared parsing it, each converting its value.
    flag_type, from_flag: what the flag parses (default: the field's type), and how that value
        becomes the option's (from_flag(name, value); default: as it is).
    nargs: argparse's, for a flag that takes several values (--lora-modules a=DIR b=DIR).
    """
    spec = dict(help=help, name=name, flags=flags, choices=tuple(choices) if choices else None,
                metavar=metavar, flag_type=flag_type, from_flag=from_flag, nargs=nargs)
    return field(default=default, metadata={"option": spec})


def whole_bytes(option: str, value: float) -> int:
    """A byte count given as a float (1e9 on the command line); inf and NaN are no count."""
    if not math.isfinite(value):
        raise OptionError(option, f"must be a number of bytes, got {value:g}")
    return int(value)


def kv_memory_bytes(option: str, value: Optional[float]) -> Optional[int]:
    """--kv-cache-memory past 1 is bytes; a fraction (0, 1] is `kv_memory_fraction`'s."""
    if value is None or 0 < value <= 1:
        return None
    if value > 1:
        return whole_bytes(option, value)
    raise OptionError(option, f"must be bytes (> 1) or a fraction of free memory in (0, 1], got {value:g}")


def kv_memory_fraction(option: str, value: Optional[float]) -> Optional[float]:
    """--kv-cache-memory in (0, 1] is a fraction of the device's free memory."""
    return value if value is not None and 0 < value <= 1 else None


def seconds_or_none(option: str, value: Optional[float]) -> Optional[float]:
    """A period in seconds where 0 means never (None)."""
    if value is None:
        return None
    check_seconds(option, value)
    return value or None


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; raises ValueError naming the dtype when it is unknown."""
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPE_BYTES)}")
    return key


def held_matrices(checkpoint: str, weight_dtype: str = "auto") -> str:
    """What the model's large matrices are held as, from the checkpoint's dtype (one of
    CHECKPOINT_DTYPES) and --weight-dtype: the float dtype --weight-dtype names (every matrix
    dequantized to it), "packed" where they are packed (in the checkpoint, or float ones packed at
    load by --weight-dtype int8/int4), else the checkpoint's own dtype."""
    if checkpoint not in CHECKPOINT_DTYPES:
        raise ValueError(f"checkpoint dtype must be one of {CHECKPOINT_DTYPES}, got {checkpoint!r}")
    if weight_dtype in MODEL_DTYPES:
        return weight_dtype
    return "packed" if weight_dtype in ("int8", "int4") else checkpoint


def resolve_dtype(device: str, cpu_flags: frozenset[str], checkpoint: str, weight_dtype: str = "auto") -> str:
    """The model dtype `--dtype auto` stands for, from where the model runs and what its
    checkpoint holds (`checkpoint`: one of CHECKPOINT_DTYPES; `cpu_flags` as /proc/cpuinfo
    names them, kvserve.kernels.cpu_flags()).

    CUDA: the checkpoint's 16-bit dtype, else bfloat16 (tensor cores; fp32 would halve speed and
    double memory for nothing the weights hold). CPU: bfloat16 only where both hold: the CPU
    multiplies bf16 natively (AVX512-BF16 or AMX-BF16; elsewhere bf16 is emulated, slower than
    fp32) and the large matrices are 16-bit in the checkpoint (so bf16 loses nothing they store,
    or fp16's 3 mantissa bits only). float32 otherwise, in particular for packed matrices (a
    quantized GGUF, or --weight-dtype int8/int4): their kernels take fp32 activations, so bf16
    would only add conversions around every product (measured in docs/defaults.md).

        resolve_dtype("cpu", frozenset({"avx512_bf16"}), "bfloat16") == "bfloat16"
        resolve_dtype("cpu", frozenset({"avx512_bf16"}), "packed") == "float32"
        resolve_dtype("cuda", frozenset(), "float32") == "bfloat16"
    """
    held = held_matrices(checkpoint, weight_dtype)
    if weight_dtype in MODEL_DTYPES:  # every matrix dequantized to this dtype: it is the model's
        return held
    sixteen_bit = held in ("bfloat16", "float16")
    if device.startswith("cuda"):
        return held if sixteen_bit else "bfloat16"
    return "bfloat16" if sixteen_bit and cpu_flags & BF16_CPU_FLAGS else "float32"


def resolve_kv_cache_dtype(device: str, cpu_flags: frozenset[str], checkpoint: str, model_dtype: str,
                           weight_dtype: str = "auto") -> str:
    """The KV cache's format `--kv-cache-dtype auto` stands for where `--dtype auto` resolved to
    `model_dtype` (arguments as resolve_dtype's): the model dtype, except for a float32 model with
    packed matrices (a quantized GGUF, or float ones packed by --weight-dtype int8/int4) on a CPU
    with bf16 instructions (AVX512-BF16 or AMX-BF16): its fp32 is what the packed kernels take, not
    what the cache needs, so there the cache is bfloat16, half the bytes every decode step reads
    (llama.cpp keeps a 16-bit cache with quantized weights too; what it costs in accuracy is
    measured in docs/defaults.md). A named --dtype keeps "auto" meaning that dtype.

        resolve_kv_cache_dtype("cpu", frozenset({"amx_bf16"}), "packed", "float32") == "bfloat16"
        resolve_kv_cache_dtype("cpu", frozenset({"avx2"}), "packed", "float32") == "float32"
    """
    packed = held_matrices(checkpoint, weight_dtype) == "packed"
    if not device.startswith("cuda") and packed and model_dtype == "float32" and cpu_flags & BF16_CPU_FLAGS:
        return "bfloat16"
    return model_dtype


def resolve_packed_activations(device: str, int8_kernels_built: bool) -> tuple[str, str]:
    """What `--packed-activations auto` stands for, and why (a sentence for the log): int8 on CPU
    where the compiled int8 kernels load (faster than float products at every row count measured, 0.1-0.4% perplexity:
    docs/defaults.md), float on CUDA and where they are missing."""
    if device.startswith("cuda"):
        return "float", "the int8 kernels are CPU kernels; packed products on CUDA dequantize in float"
    if not int8_kernels_built:
        return "float", "the compiled int8 kernels are not built here; packed products dequantize in float"
    return "int8", ("int8 activations through the compiled kernels (--exact "
                    "or --packed-activations float for the exact float products)")


def canonical_kv_cache_dtype(name: str) -> str:
    """'fp8' -> 'fp8_e4m3'; 'auto' stays; raises ValueError naming an unknown one."""
    key = KV_CACHE_ALIASES.get(name.lower(), name.lower())
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return key


def chosen_cache_layers(spec: str, num_layers: Optional[int] = None) -> Optional[tuple[int, ...]]:
    """The layers --cache-layers names, ascending; None for "all". Forms: "all", "last:N", a
    list "0,5,7" (one number is a list of one layer) or a fraction "0.25" of the layers, the last
    ones (rounded up). Without num_layers only the form is checked (the model is not
    known yet) and None is returned. chosen_cache_layers("last:2", 5) == (3, 4)."""
    def refuse(problem: str) -> OptionError:
        return OptionError("cache_layers", f"{spec!r}: {problem}")
    text = spec.strip().lower()
    if text == "all":
        return None
    try:
        if text.startswith("last:"):
            count, layers = int(text[5:]), None
        elif "." in text:
            fraction, count, layers = float(text), 0, None
        else:
            count, layers = 0, tuple(int(part) for part in text.split(","))
    except ValueError:
        raise refuse('expected "all", "last:N", a list of layers "0,5,7" or a fraction "0.25"') from None
    if "." in text and not 0 < fraction <= 1:
        raise refuse("a fraction of the layers must be in (0, 1]")
    if layers is not None and len(set(layers)) != len(layers):
        raise refuse("a layer is named twice")
    if layers is not None and min(layers) < 0:
        raise refuse("layers are numbered from 0")
    if layers is None and "." not in text and count < 1:
        raise refuse("at least one layer must keep its cache (--no-cache keeps none)")
    if num_layers is None:
        return None
    if layers is None:
        count = count or math.ceil(float(text) * num_layers - 1e-9)  # at least that share of the layers
        if count > num_layers:
            raise refuse(f"the model has {num_layers} layers")
        layers = tuple(range(num_layers - count, num_layers))
    if max(layers) >= num_layers:
        raise refuse(f"the model has layers 0..{num_layers - 1}")
    return tuple(sorted(layers))


def env_api_key() -> Optional[str]:
    return os.environ.get("KVSERVE_API_KEY") or None


KERNEL_MODES = ("auto", "off", "portable")


def env_kernel_mode() -> str:
    """KVSERVE_KERNELS: "auto" (default; each compiled kernel takes the best path this CPU runs),
    "off" (no compiled kernel; the torch paths run) or "portable" (compiled kernels, portable paths
    only)."""
    mode = os.environ.get("KVSERVE_KERNELS", "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"KVSERVE_KERNELS must be one of {KERNEL_MODES}, got {mode!r}")
    return mode


def env_cxx() -> str:
    """The C++ compiler the install builds the kernels with (CXX, else c++)."""
    return os.environ.get("CXX", "c++")


MOE_SCORINGS = ("softmax", "sigmoid")  # how router logits become expert scores
MOE_GROUP_SCORES = ("max", "top2_sum")  # how a group of experts is scored (DeepSeek-V2, V3)


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a decoder: which layers route, and the routing rule as data.

    A token's router logits [num_experts] become scores (softmax or sigmoid); with n_group > 1
    the experts form n_group groups, each scored by its best score ("max", DeepSeek-V2) or the sum
    of its best two ("top2_sum", DeepSeek-V3), and only the topk_group best groups compete. The
    num_experts_per_tok best experts (ranked by score + e_score_correction_bias where the model
    has that bias) weigh their outputs by their scores, renormalized to sum to 1 where
    norm_topk_prob, times routed_scaling_factor. Shared experts (one MLP of
    shared_expert_intermediate_size) see every token; Qwen2-MoE scales theirs by a sigmoid gate.
    dense_layers: the layers whose MLP is a dense one of the model's intermediate_size.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    score_correction_bias: bool = False
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for attr in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{attr} must be an integer >= 1, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MoEConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                             f"num_experts ({self.num_experts})")
        if self.scoring not in MOE_SCORINGS:
            raise ValueError(f"MoEConfig.scoring must be one of {MOE_SCORINGS}, got {self.scoring!r}")
        if self.group_score not in MOE_GROUP_SCORES:
            raise ValueError(f"MoEConfig.group_score must be one of {MOE_GROUP_SCORES}, got {self.group_score!r}")
        self._check_groups()
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"MoEConfig.shared_expert_intermediate_size must be >= 0, "
                             f"got {self.shared_expert_intermediate_size}")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("MoEConfig.shared_expert_gate needs a shared expert (shared_expert_intermediate_size)")
        if not math.isfinite(self.routed_scaling_factor) or self.routed_scaling_factor <= 0:
            raise ValueError(f"MoEConfig.routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))

    def _check_groups(self) -> None:
        if self.num_experts % self.n_group:
            raise ValueError(f"MoEConfig.num_experts ({self.num_experts}) must split into n_group "
                             f"({self.n_group}) equal groups")
        if self.topk_group > self.n_group:
            raise ValueError(f"MoEConfig.topk_group ({self.topk_group}) must be at most n_group ({self.n_group})")
        if self.group_score == "top2_sum" and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("MoEConfig.group_score 'top2_sum' needs at least 2 experts per group")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"MoEConfig.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts "
                             f"of the topk_group ({self.topk_group}) groups it chooses from")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether this layer's MLP is the routed experts (else a dense MLP)."""
        return layer_idx not in self.dense_layers


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one compressed
    latent per token (kv_lora_rank values) and a rotary key shared by the heads
    (qk_rope_head_dim); the cache holds only those. Each head's query is qk_nope_head_dim +
    qk_rope_head_dim wide, its value v_head_dim. q_lora_rank None: a direct q_proj (V2-Lite)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None
    rope_interleave: bool = True  # rotary pairs (x0, x1), (x2, x3), ... as DeepSeek lays them out
    # "latent": the cache holds the latent (the point of MLA); "expanded": per-head K and V, V padded
    # to the key's width, as an MHA cache of the same heads would (the baseline MLA is measured against)
    cache_form: str = "latent"

    def __post_init__(self) -> None:
        for attr in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, attr)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"MLAConfig.{attr} must be an integer >= 1, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.cache_form not in ("latent", "expanded"):
            raise ValueError(f"MLAConfig.cache_form must be 'latent' or 'expanded', got {self.cache_form!r}")
        if self.cache_form == "expanded" and self.v_head_dim > self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError("MLAConfig.cache_form 'expanded' pads values to the key's width: v_head_dim "
                             f"{self.v_head_dim} is wider than qk_nope_head_dim + qk_rope_head_dim")

    @property
    def caches_latent(self) -> bool:
        return self.cache_form == "latent"

    @property
    def latent_dim(self) -> int:
        """Values the cache holds per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder: the Llama family (Llama, Mistral, Qwen2, SmolLM, llama2.c)
    and Gemma 2 and 3 (architecture "gemma2", "gemma3"), which add GeGLU, scaled embeddings,
    norms after attention and MLP (and on q and k in Gemma 3), logit soft-capping, their own query
    scale and a local RoPE base for their sliding-window layers; the dense families "qwen3",
    "phi3", "olmo2", "smollm3" and "granite" (kvserve/models/<family>.py) with their partial
    rotary (rotary_dim), NoPE layers (nope_layers) and Granite's multipliers."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = "llama"
    name: str = "model"
    layer_types: tuple[str, ...] = ()  # per layer "full" or "sliding"; empty: every layer full
    sliding_window: Optional[int] = None  # tokens a "sliding" layer attends to, its own included
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_pre_attn_scalar: Optional[float] = None  # attention scale = this ** -0.5 (default head_dim)
    attn_logit_softcapping: Optional[float] = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: Optional[float] = None
    rope_local_theta: Optional[float] = None  # RoPE base of sliding layers (Gemma 3)
    mla: Optional[MLAConfig] = None  # latent attention (DeepSeek): what the cache holds per token
    moe: Optional[MoEConfig] = None  # mixture-of-experts layers (None: every MLP dense)
    rotary_dim: int = 0  # leading dims of each head RoPE turns (0: head_dim; Phi-4-mini: 3/4)
    nope_layers: tuple[int, ...] = ()  # layers that take no RoPE (SmolLM3: every fourth)
    attention_multiplier: Optional[float] = None  # the attention scale itself (Granite)
    embedding_multiplier: float = 1.0  # embeddings times this (Granite)
    residual_multiplier: float = 1.0  # each block's output times this before its add (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)

    def __post_init__(self) -> None:
        self._check_sizes()
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                                 or set(self.layer_types) - {"full", "sliding"}):
            raise ValueError(f"layer_types must name 'full' or 'sliding' for each of the "
                             f"{self.num_hidden_layers} layers, got {self.layer_types}")
        if "sliding" in self.layer_types and not (self.sliding_window and self.sliding_window >= 1):
            raise ValueError(f"sliding layers need a sliding_window >= 1, got {self.sliding_window}")
        if self.head_dim < 1:
            raise ValueError(f"ModelConfig.head_dim must be >= 1, got {self.head_dim} (hidden_size "
                             f"{self.hidden_size} // num_attention_heads {self.num_attention_heads})")
        self._check_rope_layout()
        self._check_multipliers()
        if self.moe is not None and any(i >= self.num_hidden_layers or i < 0 for i in self.moe.dense_layers):
            raise ValueError(f"MoEConfig.dense_layers {self.moe.dense_layers} name layers outside "
                             f"0..{self.num_hidden_layers - 1}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    def _check_sizes(self) -> None:
        """Every size a whole number >= 1 (head_dim may be 0: derived), before any is divided by."""
        for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value, least = getattr(self, attr), 0 if attr == "head_dim" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ModelConfig.{attr} must be an integer >= {least}, got {value!r}")

    def _check_rope_layout(self) -> None:
        """rotary_dim, where given, an even count of a head's dims (0: all of them); nope_layers
        real layers."""
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        elif isinstance(self.rotary_dim, bool) or not isinstance(self.rotary_dim, int) \
                or not 2 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"ModelConfig.rotary_dim must be an even integer in 2..head_dim "
                             f"({self.head_dim}), got {self.rotary_dim!r}")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_hidden_layers
               for i in self.nope_layers):
            raise ValueError(f"ModelConfig.nope_layers must name layers in 0..{self.num_hidden_layers - 1}, "
                             f"got {self.nope_layers}")
        object.__setattr__(self, "nope_layers", tuple(sorted(set(self.nope_layers))))

    def _check_multipliers(self) -> None:
        """Granite's multipliers: finite numbers, the ones divided by or used as a scale > 0."""
        for attr in ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
            value = getattr(self, attr)
            if value is None and attr == "attention_multiplier":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or (attr in ("attention_multiplier", "logits_scaling") and value <= 0):
                raise ValueError(f"ModelConfig.{attr} must be a finite number"
                                 f"{' > 0' if attr in ('attention_multiplier', 'logits_scaling') else ''}, "
                                 f"got {value!r}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """"full" or "sliding" for each layer."""
        return self.layer_types or ("full",) * self.num_hidden_layers

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by: Granite's attention_multiplier, else (query_pre_attn_scalar or
        head_dim) ** -0.5."""
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier)
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5


@dataclass(frozen=True)
class CacheConfig:
    """How the KV cache is laid out and sized.

    layout "paged": one pool of `block_size`-token blocks shared by all sequences.
    layout "contiguous": each sequence reserves one slab of `max_model_len` slots up front
    (the per-sequence preallocated cache of Hugging Face's static cache); it is modelled as a pool
    whose block size is the slab, so both layouts share the attention path and the accounting.
    """

    block_size: int = option(16)
    layout: str = option("paged", name="kv_layout", choices=KV_LAYOUTS)
    num_blocks: Optional[int] = option(None)
    memory_bytes: Optional[int] = option(  # budget for K and V of all layers
        None, "bytes for the KV cache, or a fraction (0, 1] of free device memory", name="kv_cache_memory",
        flag_type=float, from_flag=kv_memory_bytes)
    memory_fraction: Optional[float] = option(  # of the device's free memory
        None, name="kv_cache_memory_fraction", flags=("--kv-cache-memory",), from_flag=kv_memory_fraction)
    kv_cache_dtype: str = option(
        "auto", "KV cache format: auto (the model dtype; beside --dtype auto, bfloat16 for packed weights on a "
                "CPU with bf16 instructions: docs/defaults.md), float32, bfloat16, float16, fp8_e4m3, "
                "fp8_e5m2, int8 or int4 (see docs/cache.md, memory and the cache's formats)")
    kv_cache_scales: Optional[str] = option(
        None, "fp8: a JSON file of K and V scales per layer and KV head (default: calibrated at start)")
    enable_prefix_caching: bool = option(True, flags=("--no-prefix-caching",))
    eviction_policy: str = option(
        "lru", "which cached block goes first when the cache is full (after retention priority): lru, fifo, "
               "priority (the least important users' blocks) or cost (prefix depth and hits)", choices=EVICTION_POLICIES)
    populate: bool = option(
        False, "write every page of the cache on CPU while the engine starts, as vLLM and llama.cpp do, "
               "instead of when its blocks are first written: a longer start and all of the cache resident "
               "at once, but no step waits for fresh memory (docs/cache.md)",
        name="kv_cache_populate", flags=("--kv-cache-populate",))
    swap_space_bytes: int = option(1 << 30, "bytes of CPU swap for preemption", name="swap_space",
                                   flag_type=float, from_flag=whole_bytes)
    sliding_window: Optional[int] = option(  # a bounded cache
        None, "every layer attends to its last W tokens and frees the blocks behind them; "
              "sequences may then grow past --max-model-len")
    attention_sinks: int = option(
        0, "with a sliding window: also attend to the first S tokens (StreamingLLM), which "
           "count within the window")
    host_bytes: int = option(  # tiers below the pool (kvserve.engine.offload)
        0, "bytes of host RAM keeping prefix blocks evicted from the pool (0: no host tier)",
        name="kv_cache_host_bytes", flag_type=float, from_flag=whole_bytes)
    disk_dir: Optional[str] = option(
        None, "directory keeping evicted prefix blocks on disk, and the pool's at shutdown, for later "
              "runs of the same model and KV format", name="kv_cache_dir")
    disk_bytes: int = option(4 << 30, "bytes the --kv-cache-dir tier may hold", name="kv_cache_disk_bytes",
                             flag_type=float, from_flag=whole_bytes)
    cache_layers: str = option(
        "all", "the layers that keep K/V: all, last:N, a list 0,5,7 or a fraction 0.25 (the last ones); "
               "the others are recomputed from the tokens at every step (docs/cache.md)")
    kv_events: Optional[str] = option(
        None, "publish KV cache events (block stored, removed, cleared) in vLLM's format on this ZMQ "
              "address, e.g. tcp://*:5557")

    def __post_init__(self) -> None:
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"kv layout must be 'paged' or 'contiguous', got {self.layout!r}")
        check_at_least("block_size", self.block_size, 1)
        if self.num_blocks is not None:
            check_at_least("num_blocks", self.num_blocks, 1)
        if self.memory_bytes is not None:  # the flat option's name: LLM(kv_cache_memory=...)
            check_at_least("kv_cache_memory", self.memory_bytes, 1)
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise OptionError("kv_cache_memory_fraction", f"must be in (0, 1], got {self.memory_fraction}")
        check_at_least("swap_space", self.swap_space_bytes, 0)
        if self.eviction_policy not in EVICTION_POLICIES:
            raise OptionError("eviction_policy", f"must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        object.__setattr__(self, "kv_cache_dtype", canonical_kv_cache_dtype(self.kv_cache_dtype))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding window must be >= 1 token, got {self.sliding_window}")
        if self.attention_sinks < 0:
            raise ValueError(f"attention sinks must be >= 0, got {self.attention_sinks}")
        if self.attention_sinks and self.sliding_window is not None and self.attention_sinks >= self.sliding_window:
            raise ValueError(f"attention sinks ({self.attention_sinks}) must be fewer than the sliding window "
                             f"({self.sliding_window}) they count within, leaving room for recent tokens")
        check_at_least("kv_cache_host_bytes", self.host_bytes, 0)
        check_at_least("kv_cache_disk_bytes", self.disk_bytes, 0)
        chosen_cache_layers(self.cache_layers)  # its form; the layers are checked against the model
        if self.kv_cache_scales is not None and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(f"kv cache scales are for the fp8 kv cache dtypes, not {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(64)
    max_num_batched_tokens: int = option(2048)
    max_prefill_chunk: Optional[int] = option(None)  # None: up to the token budget
    policy: str = option("fcfs", flags=("--scheduling-policy",), choices=SCHEDULING_POLICIES)
    preemption_mode: str = option(
        "auto", "auto: swap or recompute each victim, whichever its measured cost favours", choices=PREEMPTION_MODES)
    # None: no bound (LLM.generate queues every prompt at once); `kvserve serve` sets one
    max_waiting: Optional[int] = option(None, "queue bound; beyond it, 503")

    def __post_init__(self) -> None:
        check_at_least("max_num_seqs", self.max_num_seqs, 1)
        check_at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_prefill_chunk is not None:
            check_at_least("max_prefill_chunk", self.max_prefill_chunk, 1)
        if self.max_waiting is not None:  # 0 would refuse every request: each waits before its first step
            check_at_least("max_waiting", self.max_waiting, 1)
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")


SPEC_METHODS = ("ngram", "draft")
SPEC_DISABLE_BATCH_SIZE = 64  # measured (benchmarks/branching.py): the largest batch where guessing still gained (1.2x)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses num_speculative_tokens tokens; the model
    verifies them in one pass. Off while more than disable_batch_size requests run."""

    method: Optional[str] = option(  # None: off
        None, "speculative decoding: ngram (prompt lookup) or draft (--speculative-model)",
        name="speculative", choices=SPEC_METHODS)
    num_speculative_tokens: int = option(4, "tokens guessed a step")
    speculative_model: Optional[str] = option(None, "the draft model (same vocabulary)")  # method "draft"
    prompt_lookup_min: int = option(
        1, "ngram: the fewest last tokens of a sequence looked up earlier in it")
    prompt_lookup_max: int = option(3, "ngram: the most (the longest match is tried first)")
    disable_batch_size: int = option(
        SPEC_DISABLE_BATCH_SIZE,
        "no guessing while more requests than this run (it costs more than it saves)",
        name="speculative_disable_batch_size")

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, got {self.method!r}")
        check_at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.method == "draft" and not self.speculative_model:
            raise ValueError("speculative method 'draft' needs a speculative_model (--speculative-model)")
        if self.method != "draft" and self.speculative_model:
            raise ValueError("speculative_model is for the 'draft' method")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt lookup needs 1 <= min <= max, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")
        check_at_least("speculative_disable_batch_size", self.disable_batch_size, 0)


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the model's heads and MLP columns split over tensor_parallel_size
    processes (ranks), each holding its share of the weights and of every cache block. Workers
    are started by multiprocessing on this machine ("mp") or as Ray actors ("ray"), which Ray
    may place on other machines."""

    tensor_parallel_size: int = option(
        1, "split the model's heads and MLP over N processes (gloo on CPU, NCCL on CUDA); "
           "each holds 1/N of the weights and of every cache block", flags=("--tensor-parallel-size", "-tp"))
    distributed_executor_backend: str = option(
        "mp", "how tensor-parallel workers start: mp (processes on this machine) or ray "
              "(Ray actors, on the machines of a running Ray cluster)", choices=EXECUTOR_BACKENDS)

    def __post_init__(self) -> None:
        check_at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed executor backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")


def lora_modules(option: str, value: Any) -> tuple[tuple[str, str], ...]:
    """--lora-modules name=path ... (or a {name: path} dict, or (name, path) pairs) as (name, path)
    pairs in the given order; a name given twice or an item without both parts is refused."""
    items = list(value.items()) if isinstance(value, dict) else list(value or ())
    pairs: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            item = (name, path) if sep else (item, "")
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, str) and x for x in item)):
            raise OptionError(option, f"takes name=path items (a PEFT adapter directory each), got {item!r}")
        pairs.append((item[0], item[1]))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise OptionError(option, f"names an adapter twice: {names}")
    return tuple(pairs)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (kvserve.models.lora): PEFT directories served beside the base model, each
    request naming its own (or none), adapters mixed row by row in one batch."""

    enable_lora: bool = option(
        False, "serve LoRA adapters (implied by --lora-modules; needed to load them at run time)")
    modules: tuple[tuple[str, str], ...] = option(
        (), "LoRA adapters to load at start, as name=path (PEFT directories: adapter_config.json and "
            "adapter_model.safetensors); a request names one as its model", name="lora_modules",
        flag_type=str, nargs="+", metavar="NAME=PATH", from_flag=lora_modules)
    max_loras: int = option(8, "the most LoRA adapters loaded at once (each serves in any batch)")
    max_lora_rank: int = option(64, "the largest LoRA rank (r) an adapter may have")

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", lora_modules("lora_modules", self.modules))
        check_at_least("max_loras", self.max_loras, 1)
        check_at_least("max_lora_rank", self.max_lora_rank, 1)
        if len(self.modules) > self.max_loras:
            raise OptionError("lora_modules", f"names {len(self.modules)} adapters, more than max_loras "
                                              f"({self.max_loras})")

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.modules)


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # not an option: `LLM(model)` and `--model` name it first
    tokenizer: Optional[str] = option(None, "tokenizer file, if not beside the model")
    device: str = option("cpu", "cpu or cuda[:N]")
    dtype: str = option(
        "auto", "float32 | bfloat16 | float16 | auto (default): bfloat16 where the checkpoint's matrices are "
                "16-bit and the device multiplies bf16 natively (CUDA; CPUs with AVX512-BF16 or AMX), else "
                "float32 (packed GGUF weights: their kernels take fp32). bf16 halves weight and KV memory and "
                "rounds activations to 8 bits of mantissa; --exact keeps float32 (docs/defaults.md)")
    max_model_len: Optional[int] = option(  # None: the model's context length
        None, "the longest sequence (default: the model's context); longer than the model was "
              "trained on is allowed, with a warning")
    seed: int = option(0)
    use_cache: bool = option(  # False: recompute the whole sequence every step
        True, "recompute every token every step (reference)", flags=("--no-cache",))
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    log_stats_interval_s: Optional[float] = option(  # None: no stats log; `kvserve serve` sets one
        None, "seconds between the engine's stats lines in the log (0: none)",
        flags=("--log-stats-interval",), from_flag=seconds_or_none)
    attention_backend: str = option(
        "auto", "decode attention: the compiled CPU kernel (auto, where it builds) or torch",
        choices=KERNEL_BACKENDS)
    linear_backend: str = option(  # models/linear.py
        "auto", "dense linear layers on CPU. auto: bf16 and fp32 through oneDNN with each weight "
                "reordered once at load (where PyTorch has oneDNN), and 1-4 bf16 rows of a shared weight "
                "(a tied head) through the compiled kernel where the CPU has AVX512-BF16; cpu-kernel: "
                "1-4 bf16 rows of every weight through the compiled kernel; torch: the stock F.linear",
        choices=KERNEL_BACKENDS)
    trace_path: Optional[str] = option(
        None, "record what every step does to the cache (JSON lines; kvserve visualize --trace draws it)",
        name="trace", metavar="FILE")
    weight_dtype: str = option(
        "auto", "weights: auto keeps a GGUF's Q8_0/Q4_0/Q4_1 packed (read by a compiled kernel), "
                "float ones in --dtype; float32/bfloat16/float16 (= --dtype) dequantize everything; "
                "int8/int4 pack float weights as Q8_0/Q4_1 at load", choices=WEIGHT_DTYPES)
    packed_activations: str = option(
        "auto", "what packed GGUF weights multiply by: float (exact: dequantize-then-multiply in fp32), "
                "int8 (activations quantized to 8 bits a block, integer dot products as llama.cpp does, "
                "prompt and decode alike: 1.1-3x faster, perplexity 0.1-0.4 percent higher, each activation off by up "
                "to half a quantization step) or auto (default): int8 on CPU where its kernel is built, "
                "else float (docs/defaults.md)", choices=PACKED_ACTIVATIONS)
    dense_copy_memory: float = option(
        0.25, "with --packed-activations auto on a CPU with AMX or AVX512-BF16: the share of available "
              "memory the bf16 copies of packed weights may take (each about 3.2x its Q4 bytes, at most 4x "
              "the packed bytes in all), multiplied by oneDNN above the CPU's policy's rows (K-quants: 8; "
              "Q4_0/Q4_1/Q8_0: 64 with AMX, never without: docs/defaults.md); 0: no copies")
    exact: bool = option(
        False, "exact products: float32 model dtype, packed weights dequantized then multiplied in fp32, "
               "an fp32 KV cache unless --kv-cache-dtype names one; slower than the defaults (which cost "
               "perplexity 0.1-0.4 percent higher on SmolLM2 Q4_1 and Gemma-3 Q4_K_M, docs/defaults.md). Conflicts with --dtype bfloat16/"
               "float16 and --packed-activations int8")

    def __post_init__(self) -> None:
        dtype = "auto" if self.dtype == "auto" else canonical_dtype(self.dtype)
        if self.weight_dtype in MODEL_DTYPES and dtype == "auto":  # float weights are held in the model dtype
            dtype = self.weight_dtype
        object.__setattr__(self, "dtype", dtype)
        self._apply_exact()
        dtype = self.dtype
        if isinstance(self.dense_copy_memory, bool) or not (isinstance(self.dense_copy_memory, numbers.Real)
                                                             and 0 <= self.dense_copy_memory <= 1):
            raise OptionError("dense_copy_memory", f"must be a fraction in [0, 1], got {self.dense_copy_memory!r}")
        if self.max_model_len is not None:
            check_at_least("max_model_len", self.max_model_len, 1)
        interval = self.log_stats_interval_s  # None: no stats log (0 would log every step)
        if interval is not None and not (isinstance(interval, numbers.Real) and 0 < interval < float("inf")):
            raise OptionError("log_stats_interval_s", f"must be seconds > 0 (None: no stats log), got {interval!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}")
        if self.weight_dtype in MODEL_DTYPES and self.weight_dtype != dtype:
            raise ValueError(f"weight dtype {self.weight_dtype} differs from the model dtype {dtype}: float "
                             "weights are held in --dtype (use auto, int8 or int4 to keep them packed)")
        if self.packed_activations not in PACKED_ACTIVATIONS:
            raise ValueError(f"packed activations must be one of {PACKED_ACTIVATIONS}, got {self.packed_activations!r}")
        for name in ("attention_backend", "linear_backend"):
            if getattr(self, name) not in KERNEL_BACKENDS:
                raise ValueError(f"{name.replace('_', ' ')} must be auto, torch or cpu-kernel, "
                                 f"got {getattr(self, name)!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    def _apply_exact(self) -> None:
        """--exact: float32 and float products; an explicit choice against them is refused by name."""
        if not self.exact:
            return
        if not isinstance(self.exact, bool):
            raise OptionError("exact", f"must be True or False, got {self.exact!r}")
        if self.dtype not in ("auto", "float32"):
            raise OptionError("exact", f"conflicts with dtype {self.dtype!r}: exact products run in float32 "
                                       "(drop --exact or --dtype)")
        if self.packed_activations == "int8":
            raise OptionError("exact", "conflicts with packed_activations 'int8': exact products multiply "
                                       "float activations (drop --exact or --packed-activations)")
        object.__setattr__(self, "dtype", "float32")
        object.__setattr__(self, "packed_activations", "float")

    @property
    def is_resolved(self) -> bool:
        """Whether no "auto" is left in the model dtype and packed activations (the engine resolves
        them once the checkpoint is loaded: kvserve.engine.llm_engine.resolve_defaults)."""
        return self.dtype != "auto" and self.packed_activations != "auto"

    @property
    def kv_cache_dtype(self) -> str:
        """The cache's format: the model dtype for "auto" (so "auto" until the dtype is resolved)."""
        return self.dtype if self.cache.kv_cache_dtype == "auto" else self.cache.kv_cache_dtype
