"""Engine options, shared by every front end: the command line's arguments, the flat keyword
options `LLM(...)` and `LLMEngine.from_options` take, and the config tree both turn into.

    argparse Namespace --engine_options()--> {"block_size": 16, ...} --engine_config()--> EngineConfig
"""

from __future__ import annotations

import argparse
import math
from dataclasses import fields
from typing import Any, Type, TypeVar

from kvserve.config import (KERNEL_BACKENDS, PACKED_ACTIVATIONS, SPEC_DISABLE_BATCH_SIZE, SPEC_METHODS,
                            WEIGHT_DTYPES, CacheConfig, EngineConfig, EXECUTOR_BACKENDS, OptionError,
                            ParallelConfig, SchedulerConfig, SpeculativeConfig)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
OPTION_ALIASES = {"kv_layout": "layout", "kv_cache_memory": "memory_bytes",
                  "kv_cache_memory_fraction": "memory_fraction", "swap_space": "swap_space_bytes",
                  "speculative": "method", "speculative_disable_batch_size": "disable_batch_size",
                  "trace": "trace_path"}
T = TypeVar("T")


def engine_config(model: str = DEFAULT_MODEL, **options: Any) -> EngineConfig:
    """Flat keyword options (as the CLI and `LLM(...)` take them) -> the config tree; an unknown
    option is a TypeError naming it."""
    parts: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "speculative": {}, "parallel": {},
                                        "engine": {}}
    targets = {"cache": CacheConfig, "scheduler": SchedulerConfig, "speculative": SpeculativeConfig,
               "parallel": ParallelConfig, "engine": EngineConfig}
    for key, value in options.items():
        key = OPTION_ALIASES.get(key, key)
        owner = next((name for name, cls in targets.items()
                      if key in {f.name for f in fields(cls)}), None)
        if owner is None or key in ("cache", "scheduler", "speculative", "parallel", "model"):
            raise TypeError(f"unknown engine option {key!r}")
        parts[owner][key] = value
    return EngineConfig(model=model, cache=CacheConfig(**parts["cache"]),
                        scheduler=SchedulerConfig(**parts["scheduler"]),
                        speculative=SpeculativeConfig(**parts["speculative"]),
                        parallel=ParallelConfig(**parts["parallel"]), **parts["engine"])


def make_engine(model: str = DEFAULT_MODEL, **options: Any):  # type: ignore[no-untyped-def]
    from kvserve.engine.llm_engine import LLMEngine
    return LLMEngine(engine_config(model, **options))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and cache")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="GGUF file, llama2.c checkpoint or directory, Hugging Face directory or hub id")
    g.add_argument("--tokenizer", default=None, help="tokenizer file, if not beside the model")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    g.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES,
                   help="weights: auto keeps a GGUF's Q8_0/Q4_0/Q4_1 packed (read by a compiled kernel), "
                        "float ones in --dtype; float32/bfloat16/float16 (= --dtype) dequantize everything; "
                        "int8/int4 pack float weights as Q8_0/Q4_1 at load")
    g.add_argument("--packed-activations", default="float", choices=PACKED_ACTIVATIONS,
                   help="what packed Q8_0/Q4_0/Q4_1 weights multiply by: float (exact: dequantize-then-"
                        "multiply in fp32) or int8 (activations quantized to 8 bits per 32-block, integer "
                        "dot products as llama.cpp does, prompt and decode alike: faster at every batch "
                        "size, each activation off by up to half a quantization step)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache format: auto (the model dtype), float32, bfloat16, float16, fp8_e4m3, "
                        "fp8_e5m2, int8 or int4 (see docs/cache.md, memory and the cache's formats)")
    g.add_argument("--kv-cache-scales", default=None,
                   help="fp8: a JSON file of K and V scales per layer and KV head (default: calibrated at start)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="the longest sequence (default: the model's context); longer than the model was "
                        "trained on is allowed, with a warning")
    g.add_argument("--sliding-window", type=int, default=None,
                   help="every layer attends to its last W tokens and frees the blocks behind them; "
                        "sequences may then grow past --max-model-len")
    g.add_argument("--attention-sinks", type=int, default=0,
                   help="with a sliding window: also attend to the first S tokens (StreamingLLM), which "
                        "count within the window")
    g.add_argument("--kv-layout", choices=["paged", "contiguous"], default="paged")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="bytes for the KV cache, or a fraction (0, 1] of free device memory")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-cache", action="store_true", help="recompute every token every step (reference)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-prefill-chunk", type=int, default=None)
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    g.add_argument("--swap-space", type=float, default=1 << 30, help="bytes of CPU swap for preemption")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--attention-backend", choices=KERNEL_BACKENDS, default="auto",
                   help="decode attention: the compiled CPU kernel (auto, where it builds) or torch")
    g.add_argument("--speculative", choices=SPEC_METHODS, default=None,
                   help="speculative decoding: ngram (prompt lookup) or draft (--speculative-model)")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens guessed a step")
    g.add_argument("--speculative-model", default=None, help="the draft model (same vocabulary)")
    g.add_argument("--speculative-disable-batch-size", type=int, default=SPEC_DISABLE_BATCH_SIZE,
                   help="no guessing while more requests than this run (it costs more than it saves)")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="record what every step does to the cache (JSON lines; kvserve visualize --trace draws it)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model's heads and MLP over N processes (gloo on CPU, NCCL on CUDA); "
                        "each holds 1/N of the weights and of every cache block")
    g.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default="mp",
                   help="how tensor-parallel workers start: mp (processes on this machine) or ray "
                        "(Ray actors, on the machines of a running Ray cluster)")
    g.add_argument("--linear-backend", choices=KERNEL_BACKENDS, default="auto",
                   help="dense linear layers on CPU. auto: bf16 and fp32 through oneDNN with each weight "
                        "reordered once at load (where PyTorch has oneDNN), and 1-4 bf16 rows of a shared weight "
                        "(a tied head) through the compiled kernel where the CPU has AVX512-BF16; cpu-kernel: "
                        "1-4 bf16 rows of every weight through the compiled kernel; torch: the stock F.linear")


def engine_options(a: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine arguments as the flat options `engine_config` takes (the model apart)."""
    opts: dict[str, Any] = dict(
        tokenizer=a.tokenizer, device=a.device, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype,
        weight_dtype=a.weight_dtype, packed_activations=a.packed_activations,
        kv_cache_scales=a.kv_cache_scales,
        max_model_len=a.max_model_len, kv_layout=a.kv_layout, block_size=a.block_size,
        num_blocks=a.num_blocks, enable_prefix_caching=not a.no_prefix_caching,
        use_cache=not a.no_cache, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, max_prefill_chunk=a.max_prefill_chunk,
        policy=a.scheduling_policy, preemption_mode=a.preemption_mode,
        swap_space=_whole_bytes("swap_space", a.swap_space), seed=a.seed, sliding_window=a.sliding_window,
        attention_sinks=a.attention_sinks, attention_backend=a.attention_backend,
        linear_backend=a.linear_backend, speculative=a.speculative,
        num_speculative_tokens=a.num_speculative_tokens, speculative_model=a.speculative_model,
        speculative_disable_batch_size=a.speculative_disable_batch_size, trace=a.trace,
        tensor_parallel_size=a.tensor_parallel_size, distributed_executor_backend=a.distributed_executor_backend)
    if a.kv_cache_memory is not None:
        if 0 < a.kv_cache_memory <= 1:
            opts["kv_cache_memory_fraction"] = a.kv_cache_memory
        elif a.kv_cache_memory > 1:
            opts["kv_cache_memory"] = _whole_bytes("kv_cache_memory", a.kv_cache_memory)
        else:  # 0, negative or NaN
            raise OptionError("kv_cache_memory", f"must be bytes (> 1) or a fraction of free memory in (0, 1], "
                                                 f"got {a.kv_cache_memory:g}")
    return opts


def _whole_bytes(option: str, value: float) -> int:
    """A byte count given as a float (1e9 on the command line); inf and NaN are no count."""
    if not math.isfinite(value):
        raise OptionError(option, f"must be a number of bytes, got {value:g}")
    return int(value)


def options_from(cls: Type[T], a: argparse.Namespace) -> T:
    """A typed options dataclass from the parsed arguments of the same names."""
    return cls(**{f.name: getattr(a, f.name) for f in fields(cls)})  # type: ignore[arg-type]
