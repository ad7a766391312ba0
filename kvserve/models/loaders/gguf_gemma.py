"""What Gemma 2 and Gemma 3 GGUF files say, read as llama.cpp reads them (llama-model.cpp): the
keys its converter writes and, where the file says nothing, the rules llama.cpp applies.

    sliding_window        {arch}.attention.sliding_window (Gemma 2 default 4096); Gemma 3 files
                          without one attend globally everywhere
    layer pattern         {arch}.attention.sliding_window_pattern where written (a period, or
                          one flag per layer), else Gemma 2: every other layer local, from layer 0;
                          Gemma 3: every 6th global (layers 5, 11, 17, ...)
    local RoPE base       Gemma 3's local layers: {arch}.rope.freq_base_swa where written, else
                          10,000, unscaled (the global ones: rope.freq_base and its scaling)
    query scale           (n_embd / n_head) ** -0.5 for the 27B models, head_dim ** -0.5 otherwise
    soft-capping          {arch}.attn_logit_softcapping (Gemma 2: default 50) and
                          {arch}.final_logit_softcapping (Gemma 2: default 30)
    norms                 stored as 1 + w already (the converter adds one to every norm weight),
                          which is what the model's norms hold: loaded as they are
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from kvserve.models.loaders.base import ModelLoadError

GEMMA_ARCHS = ("gemma2", "gemma3")
LOCAL_ROPE_THETA = 10000.0
PATTERN = {"gemma2": 2, "gemma3": 6}  # every PATTERN-th layer global
DEFAULT_WINDOW = {"gemma2": 4096}
LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}  # llama.cpp tells the 27B models by their depth
SOFTCAP_DEFAULTS = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}  # attention, final
GGUF_LAYER_RENAMES = {  # over gguf.py's common table, for both Gemma architectures
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
Get = Callable[..., Any]  # (key under the architecture, default) -> metadata value


def gemma_fields(get: Get, arch: str, path: str) -> dict[str, Any]:
    """The ModelConfig fields a Gemma file gives beyond Llama's."""
    n, hidden, heads = int(get("block_count")), int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    window = get("attention.sliding_window", DEFAULT_WINDOW.get(arch))
    kinds = layer_kinds(get("attention.sliding_window_pattern"), arch, n, path) if window else ()
    attn_cap, final_cap = SOFTCAP_DEFAULTS[arch]
    scalar = hidden / heads if n == LAYERS_OF_27B[arch] else head_dim
    return dict(
        layer_types=kinds, sliding_window=int(window) if kinds else None, head_dim=head_dim,
        hidden_act="gelu_tanh", query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=_cap(get("attn_logit_softcapping", attn_cap)),
        final_logit_softcapping=_cap(get("final_logit_softcapping", final_cap)),
        rope_local_theta=float(get("rope.freq_base_swa", LOCAL_ROPE_THETA)) if arch == "gemma3" else None)


def layer_kinds(pattern: Any, arch: str, num_layers: int, path: str) -> tuple[str, ...]:
    """Each layer's kind: pattern 6, 8 layers -> 5 sliding, 1 full, 2 sliding (layer i is global
    where (i + 1) % 6 == 0); a list of flags says per layer (true: sliding)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{path}: {arch}.attention.sliding_window_pattern has {len(pattern)} "
                                 f"flags for {num_layers} layers")
        return tuple("sliding" if flag else "full" for flag in pattern)
    period = PATTERN[arch] if pattern is None else int(pattern)
    if period < 1:
        raise ModelLoadError(f"{path}: {arch}.attention.sliding_window_pattern must be >= 1, got {period}")
    return tuple("sliding" if (i + 1) % period else "full" for i in range(num_layers))


def _cap(value: Optional[float]) -> Optional[float]:
    """A soft-cap; 0 (as llama.cpp writes "none") is None."""
    return float(value) if value else None
