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
PACKED_ACTIVATIONS = ("float", "int8")  # what packed weights multiply by
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
KV_CACHE_ALIASES = {**DTYPE_ALIASES, "fp8": "fp8_e4m3", "float8_e4m3": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
KERNEL_BACKENDS = ("auto", "torch", "cpu-kernel")  # attention_backend, linear_backend
KV_LAYOUTS = ("paged", "contiguous")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
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
           from_flag: Optional[FlagConversion] = None) -> Any:
    """A config field that is an engine option, with its default; the rest is how front ends name it.

    name: its flat name, as `LLM(...)` takes it (default: the field's).
    flags: its command-line spellings (default: "--" and the flat name with dashes). A bool
        option's flag sets the opposite of its default (`--no-cache` sets use_cache False); two
        options may share one flag, the first declared parsing it, each converting its value.
    flag_type, from_flag: what the flag parses (default: the field's type), and how that value
        becomes the option's (from_flag(name, value); default: as it is).
    """
    spec = dict(help=help, name=name, flags=flags, choices=tuple(choices) if choices else None,
                metavar=metavar, flag_type=flag_type, from_flag=from_flag)
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


def canonical_kv_cache_dtype(name: str) -> str:
    """'fp8' -> 'fp8_e4m3'; 'auto' stays; raises ValueError naming an unknown one."""
    key = KV_CACHE_ALIASES.get(name.lower(), name.lower())
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return key


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


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder: the Llama family (Llama, Mistral, Qwen2, SmolLM, llama2.c)
    and Gemma 2 and 3 (architecture "gemma2", "gemma3"), which add GeGLU, scaled embeddings,
    norms after attention and MLP (and on q and k in Gemma 3), logit soft-capping, their own query
    scale and a local RoPE base for their sliding-window layers."""

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

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """"full" or "sliding" for each layer."""
        return self.layer_types or ("full",) * self.num_hidden_layers

    @property
    def attention_scale(self) -> float:
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
        "auto", "KV cache format: auto (the model dtype), float32, bfloat16, float16, fp8_e4m3, "
                "fp8_e5m2, int8 or int4 (see docs/cache.md, memory and the cache's formats)")
    kv_cache_scales: Optional[str] = option(
        None, "fp8: a JSON file of K and V scales per layer and KV head (default: calibrated at start)")
    enable_prefix_caching: bool = option(True, flags=("--no-prefix-caching",))
    swap_space_bytes: int = option(1 << 30, "bytes of CPU swap for preemption", name="swap_space",
                                   flag_type=float, from_flag=whole_bytes)
    sliding_window: Optional[int] = option(  # a bounded cache
        None, "every layer attends to its last W tokens and frees the blocks behind them; "
              "sequences may then grow past --max-model-len")
    attention_sinks: int = option(
        0, "with a sliding window: also attend to the first S tokens (StreamingLLM), which "
           "count within the window")

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
        object.__setattr__(self, "kv_cache_dtype", canonical_kv_cache_dtype(self.kv_cache_dtype))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding window must be >= 1 token, got {self.sliding_window}")
        if self.attention_sinks < 0:
            raise ValueError(f"attention sinks must be >= 0, got {self.attention_sinks}")
        if self.attention_sinks and self.sliding_window is not None and self.attention_sinks >= self.sliding_window:
            raise ValueError(f"attention sinks ({self.attention_sinks}) must be fewer than the sliding window "
                             f"({self.sliding_window}) they count within, leaving room for recent tokens")
        if self.kv_cache_scales is not None and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(f"kv cache scales are for the fp8 kv cache dtypes, not {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(64)
    max_num_batched_tokens: int = option(2048)
    max_prefill_chunk: Optional[int] = option(None)  # None: up to the token budget
    policy: str = option("fcfs", flags=("--scheduling-policy",), choices=SCHEDULING_POLICIES)
    preemption_mode: str = option("recompute", choices=PREEMPTION_MODES)
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
            raise ValueError(f"preemption mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")


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


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # not an option: `LLM(model)` and `--model` name it first
    tokenizer: Optional[str] = option(None, "tokenizer file, if not beside the model")
    device: str = option("cpu", "cpu or cuda[:N]")
    dtype: str = option("float32", "float32 | bfloat16 | float16")
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
        "float", "what packed Q8_0/Q4_0/Q4_1 weights multiply by: float (exact: dequantize-then-"
                 "multiply in fp32) or int8 (activations quantized to 8 bits per 32-block, integer "
                 "dot products as llama.cpp does, prompt and decode alike: faster at every batch "
                 "size, each activation off by up to half a quantization step)", choices=PACKED_ACTIVATIONS)

    def __post_init__(self) -> None:
        dtype = canonical_dtype(self.dtype)
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"model dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
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

    @property
    def kv_cache_dtype(self) -> str:
        """The cache's format: the model dtype for "auto"."""
        return self.dtype if self.cache.kv_cache_dtype == "auto" else self.cache.kv_cache_dtype
