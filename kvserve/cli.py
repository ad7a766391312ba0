"""kvserve generate | chat | memory | eval | visualize | serve | bench.

User mistakes (a missing file, a bad option value, a prompt longer than the context) print one
line naming the problem and exit 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional, Sequence

from kvserve.config import DEFAULT_MODEL, OptionError, canonical_dtype, check_at_least, env_api_key
from kvserve.engine.args import add_engine_args, add_option_flags, engine_config, engine_options, options_from


class UserError(Exception):
    """A mistake in what the user asked for; printed as one line."""


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed-sampling", dest="sampling_seed", type=int, default=None,
                   help="seed of this request's sampler (default: derived from --seed)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--beam-width", type=int, default=None, help="beam search with this many beams (greedy)")
    g.add_argument("--length-penalty", type=float, default=1.0, help="beam search: score / length ** this")
    g.add_argument("--early-stopping", choices=["true", "false", "never"], default="false",
                   help="beam search: stop once beam-width hypotheses are found (true), by Hugging Face's "
                        "heuristic (false) or only when no beam can improve (never)")


def sampling_params(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kvserve.core.sampling_params import SamplingParams
    beams = a.beam_width is not None
    return SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
        min_p=a.min_p, repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        seed=a.sampling_seed if a.sampling_seed is not None else a.seed,
        stop=tuple(a.stop), ignore_eos=a.ignore_eos, use_beam_search=beams,
        beam_width=a.beam_width, n=a.beam_width if beams else 1, length_penalty=a.length_penalty,
        early_stopping={"true": True, "false": False}.get(a.early_stopping, a.early_stopping))


def engine_from(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kvserve.engine.llm_engine import LLMEngine
    return LLMEngine.from_options(a.model, **engine_options(a))


# ---- generate ----
def cmd_generate(a: argparse.Namespace) -> int:
    params = sampling_params(a)
    engine = engine_from(a)
    prompt: Any = a.prompt
    if a.chat:
        if engine.tokenizer is None or not engine.tokenizer.chat_template:
            raise UserError(f"--chat: model {a.model!r} has no chat template")
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": a.prompt}])
    t0 = time.perf_counter()
    rid = engine.add_request("cli", prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                if not a.json:
                    sys.stdout.write(out.outputs[0].delta)
                    sys.stdout.flush()
                final = out
    elapsed = time.perf_counter() - t0
    assert final is not None
    if a.json:
        print(json.dumps(generate_report(final, elapsed, engine)))
    else:
        sys.stdout.write("\n")
        if final.error:
            raise UserError(final.error)
    return 0


def generate_report(out: Any, elapsed: float, engine: Any) -> dict[str, Any]:
    c, m = out.outputs[0], out.metrics
    n = len(c.token_ids)
    ttft = m.ttft
    decode_s = elapsed - (ttft or 0.0)
    return {
        "text": c.text, "token_ids": c.token_ids, "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": n, "finish_reason": c.finish_reason, "ttft_s": ttft,
        "tpot_s": m.tpot(n), "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
        "kv_cache_bytes": m.kv_cache_bytes, "kv_blocks": m.num_kv_blocks,
        "cached_tokens": m.num_cached_tokens, "block_size": engine.plan.block_size,
        "kv_bytes_per_token": engine.plan.kv_format.bytes_per_token(engine.model_config, engine.plan.block_size),
        "spec_proposed_tokens": m.num_spec_proposed, "spec_accepted_tokens": m.num_spec_accepted,
        "spec_acceptance_rate": m.spec_acceptance_rate, "mean_accepted_length": m.mean_accepted_length,
        **({"beams": [{"text": b.text, "token_ids": b.token_ids, "score": b.score,
                       "cumulative_logprob": b.cumulative_logprob, "finish_reason": b.finish_reason}
                      for b in out.outputs]} if c.score is not None else {}),
    }


# ---- chat ----
def cmd_chat(a: argparse.Namespace) -> int:
    params = sampling_params(a)
    engine = engine_from(a)
    if engine.tokenizer is None or not engine.tokenizer.chat_template:
        raise UserError(f"model {a.model!r} has no chat template")
    messages: list[dict[str, str]] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    print("kvserve chat: type a message; /reset clears the history, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if a.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        rid = engine.add_request(None, engine.tokenizer.encode_chat(messages), params)
        reply = ""
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    sys.stdout.write(out.outputs[0].delta)
                    sys.stdout.flush()
                    reply = out.outputs[0].text
        print()
        messages.append({"role": "assistant", "content": reply})


# ---- memory ----
def memory_report(model: str, context: Optional[int], batch: int, kv_cache_dtype: str,
                  block_size: int, dtype: str = "float32", sliding_window: Optional[int] = None,
                  attention_sinks: int = 0, tensor_parallel_size: int = 1, cache_layers: str = "all") -> dict[str, Any]:
    """The cache's cost from the same formula the engine sizes its cache by (kvserve.kv.formats),
    and, where layers slide (the model's own windows, or --sliding-window), what a sequence holds
    when each such layer keeps only its window: the engine's cache groups, counted as admission
    counts them."""
    from kvserve.config import CacheConfig
    from kvserve.core.block_math import num_blocks_for
    from kvserve.distributed.tensor_parallel import shard_config
    from kvserve.kv.formats import check_format, kv_format, mha_bytes_per_token
    from kvserve.kv.sizing import cache_groups
    from kvserve.models.registry import read_model_config
    cfg = read_model_config(model)
    dtype, kv_cache_dtype = memory_dtypes(model, dtype, kv_cache_dtype)
    fmt = kv_format(kv_cache_dtype, canonical_dtype(dtype))
    check_format(fmt, cfg, block_size)
    ctx = context or cfg.max_position_embeddings
    groups = cache_groups(cfg, CacheConfig(block_size=block_size, sliding_window=sliding_window,
                                           attention_sinks=attention_sinks), max(ctx, cfg.max_position_embeddings))
    group_block_bytes = fmt.bytes_per_token(cfg, block_size) * block_size / len(groups)
    sequence_bytes = sum(g.max_blocks_held(ctx, block_size) for g in groups) * group_block_bytes
    layers_by_kind: dict[str, int] = {}
    for g in groups:
        layers_by_kind[g.kind] = layers_by_kind.get(g.kind, 0) + len(g.layers)
    per_token = fmt.bytes_per_token(cfg, block_size)
    mha = mha_bytes_per_token(fmt, cfg, block_size)
    blocks = num_blocks_for(ctx, block_size)
    residual = fmt.residual_bytes_per_sequence(cfg, block_size, canonical_dtype(dtype))
    fixed = fmt.fixed_bytes(cfg)
    rank_cfg = shard_config(cfg, tensor_parallel_size)  # what each rank's cache holds
    rank_per_token = fmt.bytes_per_token(rank_cfg, block_size)
    return {
        "tensor_parallel_size": tensor_parallel_size, "kv_heads_per_rank": rank_cfg.num_key_value_heads,
        "bytes_per_token_per_rank": rank_per_token,
        "paged_total_bytes_per_rank": rank_per_token * block_size * blocks * batch,
        "model": cfg.name, "layers": cfg.num_hidden_layers, "query_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "kv_cache_dtype": fmt.name,
        "bits_per_value": fmt.bits, "metadata_bytes_per_token": fmt.metadata_bytes_per_token(cfg, block_size),
        "bytes_per_token": per_token, "mha_bytes_per_token": mha,
        "residual_bytes_per_sequence": residual, "fixed_bytes": fixed,
        "attention": "MLA (latent)" if cfg.mla is not None else _attention_kind(cfg.num_attention_heads,
                                                                                cfg.num_key_value_heads),
        "context": ctx, "batch": batch, "total_bytes": per_token * ctx * batch + residual * batch + fixed,
        "mha_total_bytes": mha * ctx * batch, "block_size": block_size,
        "block_bytes": per_token * block_size, "blocks_per_sequence": blocks,
        "paged_total_bytes": per_token * block_size * blocks * batch + residual * batch + fixed,
        "layers_by_kind": layers_by_kind, "sliding_window": next((g.window for g in groups if g.window), None),
        "attention_sinks": attention_sinks, "sequence_bytes": sequence_bytes,
        "windowed_total_bytes": sequence_bytes * batch + residual * batch + fixed,
        "layer_tokens": _layer_tokens(layers_by_kind, ctx, next((g.window for g in groups if g.window), None)),
        "mla": _latent_report(cfg, fmt) if cfg.mla is not None else None,
        "weights": _weight_report(cfg, canonical_dtype(dtype)),
        "cache_layers": _cache_layers_report(cfg, fmt, cache_layers, block_size, ctx * batch, residual * batch + fixed),
    }


def memory_dtypes(model: str, dtype: str, kv_cache_dtype: str) -> tuple[str, str]:
    """The model dtype and KV cache format `kvserve memory` costs: as named, or for auto what the
    engine would resolve on this CPU from the checkpoint's published dtype (config.json's
    torch_dtype; a GGUF's types): kvserve.config.resolve_dtype, and beside --dtype auto
    resolve_kv_cache_dtype (a named --dtype keeps an auto cache meaning that dtype)."""
    if dtype != "auto":
        return dtype, kv_cache_dtype
    from kvserve import kernels
    from kvserve.config import resolve_dtype, resolve_kv_cache_dtype
    from kvserve.models.registry import published_dtype
    checkpoint, flags = published_dtype(model), kernels.cpu_flags()
    dtype = resolve_dtype("cpu", flags, checkpoint)
    if kv_cache_dtype == "auto":
        kv_cache_dtype = resolve_kv_cache_dtype("cpu", flags, checkpoint, dtype)
    return dtype, kv_cache_dtype


def _cache_layers_report(cfg: Any, fmt: Any, spec: str, block_size: int, num_tokens: int,
                         extra_bytes: int) -> Optional[dict[str, Any]]:
    """--cache-layers: what the cache holds when only those layers keep K/V (None: all do)."""
    from kvserve.kv.sizing import cached_layers_config
    from kvserve.runner.layer_recompute import LayerSelection
    selection = LayerSelection.of(spec, cfg.num_hidden_layers)
    if selection is None:
        return None
    num_cached = len(selection.cached)
    per_token = fmt.bytes_per_token(cached_layers_config(cfg, num_cached), block_size)
    full = fmt.bytes_per_token(cfg, block_size) * num_tokens + extra_bytes
    total = per_token * num_tokens + extra_bytes * num_cached / cfg.num_hidden_layers
    return {"spec": spec, "cached_layers": list(selection.cached), "num_recomputed": selection.num_recomputed,
            "description": selection.describe(), "bytes_per_token": per_token, "total_bytes": total,
            "full_total_bytes": full, "saving": 1 - total / full}


def _weight_report(cfg: Any, dtype: str) -> dict[str, Any]:
    """The weights at the model dtype, and what one decode token reads (an MoE layer: its active experts)."""
    from kvserve.config import DTYPE_BYTES
    from kvserve.kv.sizing import weight_params
    count = weight_params(cfg)
    total, per_token = count.bytes(DTYPE_BYTES[dtype])
    moe = cfg.moe
    return {"dtype": dtype, "params": count.total, "params_per_token": count.per_token, "bytes": total,
            "bytes_per_token": per_token, "experts": moe.num_experts if moe else None,
            "experts_per_token": moe.num_experts_per_tok if moe else None}


def _layer_tokens(layers_by_kind: dict[str, int], context: int, window: Optional[int]) -> dict[str, int]:
    """Tokens of layer K/V a sequence holds, summed over layers: every layer every token (the
    textbook formula's count) and with each sliding layer holding at most its window (counted in
    tokens, not blocks). 3 full and 15 sliding layers, 2,048 tokens, window 512: 36,864 and 13,824."""
    layers = sum(layers_by_kind.values())
    sliding = layers_by_kind.get("sliding", 0)
    held = (layers - sliding) * context + sliding * min(context, window or context)
    return {"every_layer_every_token": layers * context, "windowed": held}


def _latent_report(cfg: Any, fmt: Any) -> dict[str, Any]:
    """An MLA model's cache: the latent and rotary key per layer, next to GQA with 8 KV heads
    holding each head's key (nope + rope) and value as an MHA cache of the same heads would."""
    m = cfg.mla
    per_head = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * cfg.num_hidden_layers * fmt.bits / 8
    return {"kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim, "latent_values": m.latent_dim,
            "key_head_dim": m.qk_nope_head_dim + m.qk_rope_head_dim, "value_head_dim": m.v_head_dim,
            "gqa_kv_heads": GQA_COMPARED, "gqa_bytes_per_token": per_head * GQA_COMPARED}


GQA_COMPARED = 8  # KV heads of the GQA cache an MLA model's latent is set beside (Llama 3's count)


def _attention_kind(heads: int, kv_heads: int) -> str:
    if kv_heads == heads:
        return "MHA"
    return "MQA" if kv_heads == 1 else f"GQA ({heads // kv_heads} query heads per KV head)"


# The engine options `kvserve memory` costs a cache by, with its own words for some
MEMORY_OPTIONS = ("kv_cache_dtype", "dtype", "block_size", "sliding_window", "attention_sinks",
                  "tensor_parallel_size", "cache_layers")
MEMORY_HELP = {
    "kv_cache_dtype": "auto (the --dtype; with --dtype auto and packed weights, bfloat16 on a CPU with "
                      "AVX512-BF16 or AMX), float32, bfloat16, float16, fp8_e4m3, fp8_e5m2, int8, int4",
    "dtype": "the model dtype (what an auto KV cache means); auto: what the engine picks on this CPU for the "
             "checkpoint's published dtype (bfloat16 for a 16-bit checkpoint on a CPU with AVX512-BF16 or AMX, "
             "else float32)",
    "sliding_window": "window every layer (see kvserve generate)",
    "tensor_parallel_size": "also what each of N tensor-parallel ranks holds",
}


def cmd_memory(a: argparse.Namespace) -> int:
    for option in ("batch", "tensor_parallel_size") + (("context",) if a.context is not None else ()):
        check_at_least(option, getattr(a, option), 1)
    r = memory_report(a.model, a.context, a.batch, a.kv_cache_dtype, a.block_size, a.dtype, a.sliding_window,
                      a.attention_sinks, a.tensor_parallel_size, a.cache_layers)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"model {r['model']}: {r['layers']} layers, {r['query_heads']} query heads, "
          f"{r['kv_heads']} KV heads, head_dim {r['head_dim']} -> {r['attention']}")
    meta = f" + {r['metadata_bytes_per_token']:g} bytes of scales" if r["metadata_bytes_per_token"] else ""
    if r["mla"] is not None:
        _print_latent(r, meta)
    else:
        print(f"KV per token ({r['kv_cache_dtype']}): 2 x {r['layers']} x {r['kv_heads']} x {r['head_dim']} x "
              f"{r['bits_per_value']}/8{meta} = {r['bytes_per_token']:,.0f} bytes ({_human(r['bytes_per_token'])})")
    if r["residual_bytes_per_sequence"]:
        print(f"  plus the block being filled, unquantized: {_human(r['residual_bytes_per_sequence'])} per sequence")
    if r["fixed_bytes"]:
        print(f"  plus fixed scales: {r['fixed_bytes']:,} bytes")
    print(f"  MHA-equivalent storage ({r['query_heads']} KV heads): {r['mha_bytes_per_token']:,.0f} bytes "
          f"per token ({r['mha_bytes_per_token'] / r['bytes_per_token']:.1f}x)")
    print(f"context {r['context']:,} x batch {r['batch']}: {r['total_bytes']:,.0f} bytes "
          f"({_human(r['total_bytes'])}); MHA-equivalent {_human(r['mha_total_bytes'])}")
    print(f"paged, block size {r['block_size']}: {r['blocks_per_sequence']} blocks of "
          f"{_human(r['block_bytes'])} per sequence, {_human(r['paged_total_bytes'])} in all")
    if r["sliding_window"]:
        kinds = ", ".join(f"{n} {k}" for k, n in r["layers_by_kind"].items())
        sinks = f" + {r['attention_sinks']} sinks" if r["attention_sinks"] else ""
        print(f"with sliding layers ({kinds}; window {r['sliding_window']}{sinks}), a sliding layer keeps "
              f"only its window's blocks: {_human(r['sequence_bytes'])} per sequence, "
              f"{_human(r['windowed_total_bytes'])} in all ({r['paged_total_bytes'] / r['windowed_total_bytes']:.1f}x less)")
        _print_hybrid(r)
    if r["tensor_parallel_size"] > 1:
        tp, per_rank = r["tensor_parallel_size"], r["bytes_per_token_per_rank"]
        replicated = tp * r["kv_heads_per_rank"] > r["kv_heads"]
        print(f"tensor parallel {tp}: each rank holds {r['kv_heads_per_rank']} KV head(s)"
              f"{' (replicated: fewer KV heads than ranks)' if replicated else ''}, {per_rank:,.0f} bytes per token, "
              f"{_human(r['paged_total_bytes_per_rank'])} per rank for this context and batch")
    if r["cache_layers"] is not None:
        _print_cache_layers(r["cache_layers"])
    _print_weights(r["weights"])
    return 0


def _print_cache_layers(c: dict[str, Any]) -> None:
    print(f"--cache-layers {c['spec']}: {c['description']}")
    print(f"  {c['bytes_per_token']:,.0f} bytes per token; {c['total_bytes']:,.0f} bytes ({_human(c['total_bytes'])}) "
          f"for this context and batch instead of {_human(c['full_total_bytes'])}: {c['saving']:.1%} less. "
          f"Each step runs the {c['num_recomputed']} recomputed layers over whole sequences")


def _print_hybrid(r: dict[str, Any]) -> None:
    """The textbook figure, every layer holding every token, beside what the layers hold when the
    sliding ones keep only their window (per sequence, in tokens of layer K/V)."""
    per_layer_token = r["bytes_per_token"] / r["layers"]
    every, held = r["layer_tokens"]["every_layer_every_token"], r["layer_tokens"]["windowed"]
    sliding = r["layers_by_kind"].get("sliding", 0)
    print(f"  every layer holding every token: 2 x {r['bits_per_value'] // 8 or r['bits_per_value'] / 8:g} x "
          f"{r['layers']} x {r['kv_heads']} x {r['head_dim']} x {r['context']:,} = {every * per_layer_token:,.0f} bytes "
          f"({_human(every * per_layer_token)}) per sequence; with the {sliding} sliding layers holding their "
          f"{r['sliding_window']:,} tokens: {held * per_layer_token:,.0f} bytes ({_human(held * per_layer_token)}, "
          f"{every / held:.1f}x less)")


def _print_weights(w: dict[str, Any]) -> None:
    experts = (f" (active experts only: {w['experts_per_token']} of {w['experts']} per MoE layer)"
               if w["experts"] else "")
    print(f"weights ({w['dtype']}): {w['params'] / 1e9:,.2f}B parameters, {_human(w['bytes'])}; a decode token "
          f"reads {w['params_per_token'] / 1e9:,.2f}B, {_human(w['bytes_per_token'])}{experts}")


def _print_latent(r: dict[str, Any], meta: str) -> None:
    m = r["mla"]
    print(f"KV per token ({r['kv_cache_dtype']}, latent): {r['layers']} x ({m['kv_lora_rank']} latent + "
          f"{m['qk_rope_head_dim']} rotary key) x {r['bits_per_value']}/8{meta} = {r['bytes_per_token']:,.0f} bytes "
          f"({_human(r['bytes_per_token'])})")
    print(f"  GQA with {m['gqa_kv_heads']} KV heads (key {m['key_head_dim']}, value {m['value_head_dim']} each): "
          f"{m['gqa_bytes_per_token']:,.0f} bytes per token ({m['gqa_bytes_per_token'] / r['bytes_per_token']:.1f}x)")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    return str(n)


# ---- eval ----
def cmd_eval(a: argparse.Namespace) -> int:
    check_windows(a)
    try:
        with open(a.text, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UserError(f"--text {a.text}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    if a.chunk < 1 or a.context < 2:
        raise UserError(f"need --chunk >= 1 and --context >= 2, got {a.chunk} and {a.context}")
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.models.registry import load_weights
    opts = {**engine_options(a), "max_num_batched_tokens": a.chunk, "max_prefill_chunk": a.chunk, "max_num_seqs": 1}
    if not a.stream:
        opts["max_model_len"] = max(a.context, a.max_model_len or 0)
    elif a.reference_kv_dtype or a.reference_exact:
        raise UserError("--reference-kv-dtype and --reference-exact compare windows (--context, --stride), not --stream")
    loaded = load_weights(a.model, a.tokenizer)  # one copy of the weights for both engines
    engine = LLMEngine.from_options(a.model, loaded=loaded, **opts)
    trained = engine.model_config.max_position_embeddings
    if not a.stream and a.context > trained and not a.max_model_len:
        raise UserError(f"--context {a.context} is longer than the model's context ({trained}); "
                        "give --max-model-len too to run windows past it")
    if engine.tokenizer is None:
        raise UserError(f"model {a.model!r} has no tokenizer to read --text with")
    tokens = engine.tokenizer.encode(text)[:a.max_text_tokens]
    if len(tokens) < 2:
        raise UserError(f"--text {a.text} holds {len(tokens)} tokens; at least 2 are needed")
    if a.stream:
        return _print_stream(engine, tokens, a)
    reference = None
    if a.reference_kv_dtype or a.reference_exact:
        reference = LLMEngine.from_options(a.model, loaded=loaded, **reference_options(opts, a))
    r = score_text(engine, tokens, a, reference)
    if a.json:
        print(json.dumps(r.as_dict()))
        return 0
    print(f"{r.num_tokens:,} tokens scored ({_windows_text(r)}), kv cache {r.kv_cache_dtype}: "
          f"perplexity {r.perplexity:.4f}")
    if reference is not None:
        assert r.delta_perplexity is not None and r.mean_kl is not None and r.top1_agreement is not None
        what = "the exact path (--exact)" if a.reference_exact else f"kv cache {r.reference_kv_dtype}"
        print(f"reference {what}: perplexity {r.reference_perplexity:.4f}; "
              f"delta {100 * r.delta_perplexity:+.3f}%, mean KL {r.mean_kl:.6f}, top-1 agreement "
              f"{100 * r.top1_agreement:.2f}%")
    return 0


def check_windows(a: argparse.Namespace) -> None:
    """The options of --windows that go together, checked before the model loads."""
    from kvserve.eval import LLAMA_CPP
    if a.windows != LLAMA_CPP:
        if a.chunks is not None:
            raise UserError(f"--chunks counts the chunks of --windows {LLAMA_CPP}; give it too "
                            "(or --max-text-tokens to score less of the text)")
        return
    if a.stride is not None:
        raise UserError(f"--stride moves strided windows; --windows {LLAMA_CPP} cuts chunks of --context "
                        "tokens with no overlap")
    if a.stream:
        raise UserError(f"--stream scores the text as one sequence, not in --windows {LLAMA_CPP}")
    from kvserve.eval.perplexity import check_llama_cpp_options
    check_llama_cpp_options(a.context, a.chunks)


def score_text(engine: Any, tokens: list[int], a: argparse.Namespace, reference: Any) -> Any:
    """The PerplexityResult of `tokens` in the windows --windows names."""
    from kvserve.eval import LLAMA_CPP
    from kvserve.eval.perplexity import llama_cpp_perplexity, perplexity
    if a.windows == LLAMA_CPP:
        return llama_cpp_perplexity(engine, tokens, a.context, a.chunks, reference, progress=not a.json)
    return perplexity(engine, tokens, a.context, a.stride or a.context, reference, progress=not a.json)


def _windows_text(r: Any) -> str:
    from kvserve.eval import LLAMA_CPP
    if r.windowing == LLAMA_CPP:
        return (f"{LLAMA_CPP} windows: {len(r.windows)} chunk(s) of {r.context}, each scoring its last "
                f"{r.context // 2 - 1}")
    return f"context {r.context}, stride {r.stride}"


def reference_options(opts: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """The reference engine's options: the scored engine's, with --reference-kv-dtype's cache
    format, and with --reference-exact the exact path (float32, float products, an fp32 cache
    unless --reference-kv-dtype names one) in place of the scored engine's dtype choices."""
    ref = {**opts, "kv_cache_dtype": a.reference_kv_dtype or opts["kv_cache_dtype"]}
    if a.reference_exact:
        ref.update(exact=True, dtype="auto", packed_activations="auto",
                   kv_cache_dtype=a.reference_kv_dtype or "auto")
    return ref


def _print_stream(engine: Any, tokens: list[int], a: argparse.Namespace) -> int:
    from kvserve.eval.perplexity import stream
    try:
        r = stream(engine, tokens, a.segment, progress=not a.json)
    except ValueError as e:
        if engine.unbounded or len(tokens) <= engine.max_model_len:
            raise
        raise UserError(f"{e}: a stream longer than the context needs --sliding-window (with --attention-sinks), "
                        "or --max-model-len past the model's own for a dense cache") from e
    if a.json:
        print(json.dumps(r.as_dict()))
        return 0
    cache = (f"window {r.sliding_window}" + (f" with {r.attention_sinks} sinks" if r.attention_sinks else "")
             if r.sliding_window else "dense")
    print(f"{r.num_tokens:,} tokens scored as one stream ({cache}, kv cache {r.kv_cache_dtype}): perplexity "
          f"{r.perplexity:.4f}; at most {r.max_blocks_held} blocks held ({_human(r.max_bytes_held)})")
    print(f"{'tokens':>16} {'perplexity':>11} {'max blocks':>11}")
    for seg in r.segments:
        print(f"{seg['first']:>7,}-{seg['first'] + seg['tokens'] - 1:<8,} {seg['perplexity']:>11.3f} "
              f"{seg['max_blocks_held']:>11}")
    return 0


# ---- visualize ----
def cmd_visualize(a: argparse.Namespace) -> int:
    from kvserve.server.visualize import visualize
    if a.trace_file is not None and a.model is not None:
        raise UserError("give --trace (draw a recorded run) or --model (record the scenario), not both")
    shown = visualize(a.out, a.model, a.trace_file, a.save_trace)
    print(f"wrote {a.out}: {shown['steps']} steps, {shown['copy_on_write']} copy-on-write, "
          f"{shown['preemptions']} preemption(s), {shown['evictions']} eviction(s), "
          f"prefix hit rate {100 * shown['prefix_hit_rate']:.0f}%; open it in a browser")
    return 0


# ---- serve / bench ----
def cmd_serve(a: argparse.Namespace) -> int:
    from kvserve.server.args import ServeOptions
    options = options_from(ServeOptions, a)  # every setting checked before the model loads ...
    engine = engine_options(a)
    engine_config(a.model, **engine)  # ... here, not in each replica of -dp N
    if options.data_parallel_size > 1:
        from kvserve.server.replicas import serve_replicas
        return serve_replicas(a.model, engine, options)
    from kvserve.server.app import serve
    return serve(a.model, engine, options)


def cmd_router(a: argparse.Namespace) -> int:
    from kvserve.server.router import RouterOptions, RoutingPolicy, load_tokenizer, run_router
    options = RouterOptions(a.host, a.port, a.api_key or env_api_key(), a.max_body_bytes, a.shutdown_timeout,
                            RoutingPolicy() if a.overlap_weight is None else RoutingPolicy(a.overlap_weight))
    tokenizer = load_tokenizer(a.model, a.tokenizer) if a.model else None
    return run_router(a.replica, options, tokenizer=tokenizer)


def cmd_bench(a: argparse.Namespace) -> int:
    from kvserve.bench.args import ServeBenchOptions, ThroughputOptions
    if a.bench == "throughput":
        from kvserve.bench.throughput import run_throughput
        return run_throughput(a.model, engine_options(a), options_from(ThroughputOptions, a))
    from kvserve.bench.serve import run_serve_bench
    return run_serve_bench(options_from(ServeBenchOptions, a))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion, streamed to the terminal")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object with text and figures")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive multi-turn chat using the model's template")
    c.add_argument("--system", default=None, help="a system message")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat, max_tokens=512)
    m = sub.add_parser("memory", help="KV cache size per token and in total")
    m.add_argument("--model", default=DEFAULT_MODEL, help="model file or a known name")
    m.add_argument("--context", type=int, default=None, help="tokens per sequence (default: model's)")
    m.add_argument("--batch", type=int, default=1)
    add_option_flags(m, MEMORY_OPTIONS, MEMORY_HELP)
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_memory)
    e = sub.add_parser("eval", help="evaluations through the real cache")
    esub = e.add_subparsers(dest="eval", required=True)
    ep = esub.add_parser("perplexity", help="perplexity of a text (and KL against a reference cache format)")
    ep.add_argument("--text", required=True, help="a UTF-8 text file")
    ep.add_argument("--context", type=int, default=2048, help="tokens per window")
    ep.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: --context)")
    ep.add_argument("--chunk", type=int, default=512, help="prefill chunk: later chunks read earlier ones from the cache")
    ep.add_argument("--reference-kv-dtype", default=None, help="also run this cache format: KL, top-1, delta")
    ep.add_argument("--reference-exact", action="store_true",
                    help="also run the exact path (--exact): what the defaults cost, as KL, top-1 and delta")
    ep.add_argument("--max-text-tokens", type=int, default=None, help="score only the first N tokens")
    from kvserve.eval import STRIDED, WINDOWINGS
    ep.add_argument("--windows", choices=WINDOWINGS, default=STRIDED,
                    help="strided: a window of --context tokens every --stride, each token scored once; "
                         "llama.cpp: as llama-perplexity -c CONTEXT, whole chunks of --context tokens with no "
                         "overlap, BOS first, each scoring its second half")
    ep.add_argument("--chunks", type=int, default=None, metavar="N",
                    help="with --windows llama.cpp: score only the first N chunks (llama-perplexity's --chunks; "
                         "default: every whole chunk)")
    ep.add_argument("--stream", action="store_true",
                    help="score the text as one sequence (with --sliding-window and --attention-sinks: "
                         "StreamingLLM), perplexity per --segment tokens")
    ep.add_argument("--segment", type=int, default=2000, help="tokens per reported segment of a --stream")
    ep.add_argument("--json", action="store_true")
    add_engine_args(ep)
    ep.set_defaults(func=cmd_eval)
    v = sub.add_parser("visualize", help="a step-through of the cache as a self-contained HTML page")
    v.add_argument("--model", default=None, help="model to record the scenario on (default: stories260K "
                   "from ../shared/models)")
    v.add_argument("--trace", dest="trace_file", default=None, metavar="FILE",
                   help="draw this recorded trace (--trace of generate/serve) instead of the scenario")
    v.add_argument("--out", default="kvcache.html", help="the HTML file to write")
    v.add_argument("--save-trace", default=None, metavar="FILE", help="also keep the scenario's trace")
    v.set_defaults(func=cmd_visualize)
    from kvserve.server.args import ServeOptions, add_serve_args
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)
    r = sub.add_parser("router", help="one OpenAI endpoint over running kvserve servers, routed by cache affinity")
    r.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a kvserve server (repeat for each), e.g. http://10.0.0.2:8000")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--api-key", default=None, help="required of clients, and passed on to the replicas")
    r.add_argument("--max-body-bytes", type=int, default=ServeOptions.max_body_bytes,
                   help="larger bodies are refused with 413 (counted as they arrive), as by a server")
    r.add_argument("--shutdown-timeout", type=float, default=ServeOptions.shutdown_timeout,
                   help="seconds open requests get to finish on SIGTERM; then they are closed")
    r.add_argument("--model", default=None,
                   help="the replicas' model, whose tokenizer names requests' KV blocks as the replicas do "
                        "(without it requests are routed by load alone)")
    r.add_argument("--tokenizer", default=None, help="a tokenizer.json to use instead of the model's")
    r.add_argument("--overlap-weight", type=float, default=None,
                   help="cost = weight * (blocks to prefill on a replica) + (blocks in flight there); "
                        "default: RoutingPolicy's, 1")
    r.set_defaults(func=cmd_router)
    b = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = b.add_subparsers(dest="bench", required=True)
    from kvserve.bench.args import add_serve_bench_args, add_throughput_args
    bt = bsub.add_parser("throughput", help="offline throughput vs Hugging Face generate()")
    add_engine_args(bt)
    add_throughput_args(bt)
    bs = bsub.add_parser("serve", help="load a running server like `vllm bench serve`")
    add_serve_bench_args(bs)
    b.set_defaults(func=cmd_bench)
    return p


def _as_typed(e: Exception) -> str:
    """The error as the user typed what it names: an option the command line has as a flag
    (num_blocks: --num-blocks); any other field (a sampling parameter's) as it is."""
    if not isinstance(e, OptionError):
        return str(e)
    return e.as_flag if f"--{e.option.replace('_', '-')}" in _flags(build_parser()) else str(e)


def _flags(p: argparse.ArgumentParser) -> set[str]:
    """Every --flag of the parser and its subcommands."""
    flags = set()
    for action in p._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _flags(sub)
    return flags


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from kvserve.models.loaders.base import ModelLoadError
    try:
        return int(args.func(args) or 0)
    except (UserError, ModelLoadError, ValueError, FileNotFoundError, IsADirectoryError,
            PermissionError) as e:
        print(f"kvserve: error: {_as_typed(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
