"""Hugging Face model directories (config.json, *.safetensors, tokenizer.json) and hub ids."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Optional

import torch

from kvserve.config import ModelConfig
from kvserve.models.loaders.base import LoadedModel, ModelLoadError
from kvserve.tokenizer.hf import HFTokenizer, from_tokenizer_json

SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
             "Qwen2ForCausalLM": "qwen2", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model"]


def download(repo_id: str) -> str:
    """Fetch a hub repository's config, weights and tokenizer; the local snapshot directory."""
    try:
        from huggingface_hub import snapshot_download
        return str(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown id, gated repository, ...
        raise ModelLoadError(f"could not fetch model {repo_id!r} from the Hugging Face hub "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                             f"pass a local path instead") from e


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return dict(json.load(f))


def read_config(directory: str) -> ModelConfig:
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise ModelLoadError(f"{directory}: no config.json")
    c = _read_json(path)
    arch = next((SUPPORTED[a] for a in c.get("architectures", []) if a in SUPPORTED), None)
    if arch is None:
        raise ModelLoadError(f"{directory}: unsupported architecture {c.get('architectures')}; "
                             f"supported: {sorted(SUPPORTED)}")
    heads = c["num_attention_heads"]
    rope = c.get("rope_parameters") or {}  # transformers >= 5 keeps theta and scaling here
    if arch == "gemma3" and "full_attention" in rope:  # one set per layer type
        local = rope.get("sliding_attention", {}).get("rope_theta", c.get("rope_local_base_freq", 10000.0))
        rope = rope["full_attention"]
    else:
        local = c.get("rope_local_base_freq", 10000.0) if arch == "gemma3" else None
    theta = c.get("rope_theta", rope.get("rope_theta", 1_000_000.0 if arch == "gemma3" else 10000.0))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    layer_types, window = _layer_types(c, arch)
    gemma = arch in ("gemma2", "gemma3")
    return ModelConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=c.get("tie_word_embeddings", gemma),
        attention_bias=c.get("attention_bias", arch == "qwen2"), architecture=arch,
        name=c.get("_name_or_path") or os.path.basename(os.path.normpath(directory)),
        layer_types=layer_types, sliding_window=window,
        hidden_act="gelu_tanh" if gemma else "silu",
        query_pre_attn_scalar=c.get("query_pre_attn_scalar") if gemma else None,
        attn_logit_softcapping=c.get("attn_logit_softcapping", 50.0 if arch == "gemma2" else None),
        final_logit_softcapping=c.get("final_logit_softcapping", 30.0 if arch == "gemma2" else None),
        rope_local_theta=local)


def _layer_types(c: dict[str, Any], arch: str) -> tuple[tuple[str, ...], Optional[int]]:
    """Which layers attend through a sliding window, from the config's layer_types or, in older
    configs, each family's rule (Mistral: all; Qwen2: from max_window_layers on, when
    use_sliding_window; Gemma 2: every other; Gemma 3: all but every sliding_window_pattern-th)."""
    n, window = c["num_hidden_layers"], c.get("sliding_window")
    if arch == "qwen2" and not c.get("use_sliding_window", False):
        window = None
    if window is None:
        return (), None
    if c.get("layer_types"):
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in c["layer_types"])
    elif arch == "qwen2":
        kinds = tuple("sliding" if i >= c.get("max_window_layers", n) else "full" for i in range(n))
    elif arch == "gemma2":
        kinds = tuple("sliding" if (i + 1) % 2 else "full" for i in range(n))
    elif arch == "gemma3":
        pattern = c.get("sliding_window_pattern", 6)
        kinds = tuple("sliding" if (i + 1) % pattern else "full" for i in range(n))
    else:
        kinds = ("sliding",) * n
    return (kinds, window) if "sliding" in kinds else ((), None)


def load(directory: str, tokenizer_path: Optional[str] = None) -> LoadedModel:
    from safetensors.torch import load_file
    cfg = read_config(directory)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    tok = _tokenizer(directory, tokenizer_path)
    return LoadedModel(cfg, sd, tok, f"hf:{os.path.abspath(directory)}")


def _tokenizer(directory: str, explicit: Optional[str]) -> Optional[HFTokenizer]:
    path = explicit or os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        return None
    tc_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    tc = _read_json(tc_path) if os.path.exists(tc_path) else {}
    from tokenizers import Tokenizer as RawTokenizer
    raw = RawTokenizer.from_file(path)

    def token_id(key: str) -> Optional[int]:
        tok = tc.get(key)
        tok = tok.get("content") if isinstance(tok, dict) else tok
        return raw.token_to_id(tok) if isinstance(tok, str) else None

    eos_ids = [i for i in [token_id("eos_token")] if i is not None]
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.exists(gen_path):
        gen_eos = _read_json(gen_path).get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(i, int) and i not in eos_ids:
                eos_ids.append(i)
    template = tc.get("chat_template")
    return from_tokenizer_json(path, token_id("bos_token"), eos_ids,
                               template if isinstance(template, str) else None)


__all__ = ["download", "read_config", "load", "HFTokenizer"]
