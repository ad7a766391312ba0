"""Hugging Face model directories (config.json, *.safetensors, tokenizer.json) and hub ids."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Optional

import torch

from kvserve.config import MLAConfig, ModelConfig
from kvserve.models.loaders import experts, families
from kvserve.models.gemma import norms_plus_one
from kvserve.models.loaders.base import LoadedModel, ModelLoadError
from kvserve.tokenizer.hf import HFTokenizer, from_tokenizer_json

MLA_ARCHS = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
             "Qwen2ForCausalLM": "qwen2", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
             **experts.HF_MOE_ARCHS, **MLA_ARCHS, **families.HF_ARCHS}
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


MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma2": "gemma2",
               "gemma3_text": "gemma3", **experts.HF_MOE_MODEL_TYPES,
               "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3",
               **families.HF_MODEL_TYPES}  # model_type, where no architectures
_REQUIRED: Any = object()
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
          dict: "an object"}


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from a file; anything else is a ModelLoadError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") \
            from None
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object, not {type(value).__name__}")
    return value


class _Fields:
    """A JSON object's fields, each type-checked as it is read: one that is missing or of the
    wrong type is a ModelLoadError naming the file and the field (nested ones by their path,
    rope_parameters.rope_theta), not a KeyError or a TypeError far from the file."""

    def __init__(self, path: str, values: dict[str, Any], prefix: str = "") -> None:
        self.path, self.values, self.prefix = path, values, prefix

    def get(self, key: str, kind: type, default: Any = _REQUIRED) -> Any:
        """values[key] as a `kind` (an int is a float too; a bool is no number); absent or null
        is `default`, an error where there is none."""
        value = self.values.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"{self.path}: field {self.prefix + key!r} is missing")
            return default
        if not _is(value, kind):
            raise ModelLoadError(f"{self.path}: field {self.prefix + key!r} must be {_KINDS[kind]}, "
                                 f"got {value!r}")
        return float(value) if kind is float else value

    def get_or_null(self, key: str, kind: type, absent: Any) -> Any:
        """As get, where null says None (no soft-capping) and only an absent key is `absent`."""
        return self.get(key, kind, None) if key in self.values else absent

    def has(self, key: str) -> bool:
        return self.values.get(key) is not None

    def section(self, key: str) -> "_Fields":
        """A nested object (absent: an empty one)."""
        return _Fields(self.path, self.get(key, dict, {}), f"{self.prefix}{key}.")

    def strings(self, key: str) -> list[str]:
        """A list of strings (absent: empty)."""
        items = self.get(key, list, [])
        if not all(isinstance(x, str) for x in items):
            raise ModelLoadError(f"{self.path}: field {self.prefix + key!r} must be a list of strings, "
                                 f"got {items!r}")
        return list(items)


def _is(value: Any, kind: type) -> bool:
    """Whether a JSON value is a `kind`: an integer is a number too; true and false are neither."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


def read_config(directory: str) -> ModelConfig:
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise ModelLoadError(f"{directory}: no config.json")
    c = _Fields(path, _read_json(path))
    arch = _architecture(c)
    gemma, gemma2 = arch in ("gemma2", "gemma3"), arch == "gemma2"
    theta, scaling, local = _rope(c, arch)
    layer_types, window = _layer_types(c, arch)
    heads = c.get("num_attention_heads", int)
    fields = dict(
        vocab_size=c.get("vocab_size", int), hidden_size=c.get("hidden_size", int),
        intermediate_size=c.get("intermediate_size", int), num_hidden_layers=c.get("num_hidden_layers", int),
        num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads", int, heads),
        head_dim=c.get("head_dim", int, 0),  # 0: hidden_size // heads
        max_position_embeddings=c.get("max_position_embeddings", int, 2048),
        rms_norm_eps=c.get("rms_norm_eps", float, 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=c.get("tie_word_embeddings", bool, gemma),
        attention_bias=c.get("attention_bias", bool, c.get("qkv_bias", bool, arch in ("qwen2", "qwen2_moe"))),
        architecture=arch,
        name=c.get("_name_or_path", str, "") or os.path.basename(os.path.normpath(directory)),
        layer_types=layer_types, sliding_window=window,
        hidden_act="gelu_tanh" if gemma else "silu",
        query_pre_attn_scalar=c.get("query_pre_attn_scalar", float, None) if gemma else None,
        attn_logit_softcapping=c.get_or_null("attn_logit_softcapping", float, 50.0 if gemma2 else None),
        final_logit_softcapping=c.get_or_null("final_logit_softcapping", float, 30.0 if gemma2 else None),
        rope_local_theta=local)
    try:
        fields["moe"] = experts.hf_moe_config(c.get, arch, fields["num_hidden_layers"], fields["intermediate_size"])
        if arch in MLA_ARCHS.values():
            fields.update(_deepseek_fields(c, arch, fields["num_hidden_layers"]))
        families.check_rope_scaling(path, arch, scaling)
        fields.update(families.hf_fields(c, arch, fields["head_dim"] or fields["hidden_size"] // max(heads, 1),  # heads < 1: ModelConfig names it
                                         fields["num_hidden_layers"], scaling))
        return ModelConfig(**fields)
    except ModelLoadError:
        raise
    except ValueError as e:  # a value of the right type that cannot be (hidden_size 0)
        raise ModelLoadError(f"{path}: {e}") from None


def _deepseek_fields(c: _Fields, arch: str, num_layers: int) -> dict[str, Any]:
    """DeepSeek-V2/V3: the latent attention's shapes (head_dim: a query head, nope + rope) and,
    where any layer routes (first_k_dense_replace < layers), the experts."""
    mla = MLAConfig(c.get("kv_lora_rank", int), c.get("qk_nope_head_dim", int), c.get("qk_rope_head_dim", int),
                    c.get("v_head_dim", int), c.get("q_lora_rank", int, None),
                    # V2's rotation works on interleaved pairs always; V3 says so in rope_interleave
                    arch == "deepseek_v2" or c.get("rope_interleave", bool, True))
    dense = c.get("first_k_dense_replace", int, 0)

    def get(key: str, kind: type, default: Any = _REQUIRED) -> Any:  # V3 routes by noaux_tc, unnamed in its config
        return c.get(key, kind, "noaux_tc" if key == "topk_method" and arch == "deepseek_v3" else default)
    moe = experts.deepseek_moe_config(get, num_layers) if dense < num_layers else None
    return {"mla": mla, "head_dim": mla.qk_nope_head_dim + mla.qk_rope_head_dim, "moe": moe}


def _architecture(c: _Fields) -> str:
    """Which family: the first supported name in `architectures`, or, where the config names
    none, its `model_type`."""
    names = c.strings("architectures")
    model_type = c.get("model_type", str, None)
    arch = next((SUPPORTED[a] for a in names if a in SUPPORTED), None)
    if arch is None and not names:
        if model_type is None:
            raise ModelLoadError(f"{c.path}: neither field 'architectures' nor 'model_type' says which model "
                                 f"this is; supported: {sorted(SUPPORTED)}")
        arch = MODEL_TYPES.get(model_type)
    if arch is None:
        raise ModelLoadError(f"{c.path}: unsupported architecture {names or model_type!r}; "
                             f"supported: {sorted(SUPPORTED)}")
    return arch


def _rope(c: _Fields, arch: str) -> tuple[float, Optional[dict[str, Any]], Optional[float]]:
    """RoPE's base, its scaling (None: none) and, for Gemma 3, its sliding layers' base."""
    rope = c.section("rope_parameters")  # transformers >= 5 keeps theta and scaling here
    if arch == "gemma3" and rope.has("full_attention"):  # one set per layer type
        local = rope.section("sliding_attention").get("rope_theta", float,
                                                      c.get("rope_local_base_freq", float, 10000.0))
        rope = rope.section("full_attention")
    else:
        local = c.get("rope_local_base_freq", float, 10000.0) if arch == "gemma3" else None
    default_theta = 1_000_000.0 if arch == "gemma3" else 10000.0
    theta = c.get("rope_theta", float, rope.get("rope_theta", float, default_theta))
    scaling = c.get("rope_scaling", dict, None) or \
        (rope.values if rope.get("rope_type", str, "default") != "default" else None)
    return theta, scaling, local


def _layer_types(c: _Fields, arch: str) -> tuple[tuple[str, ...], Optional[int]]:
    """Which layers attend through a sliding window, from the config's layer_types or, in older
    configs, each family's rule (Mistral: all; Qwen2: from max_window_layers on, when
    use_sliding_window; Gemma 2: every other; Gemma 3: all but every sliding_window_pattern-th)."""
    n, window = c.get("num_hidden_layers", int), c.get("sliding_window", int, None)
    if arch in ("qwen2", "qwen2_moe", "qwen3_moe", "qwen3", "smollm3") and not c.get("use_sliding_window", bool, False):
        window = None
    if window is None:
        return (), None
    named = c.strings("layer_types")
    if named:
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in named)
    elif arch == "qwen2":
        first = c.get("max_window_layers", int, n)
        kinds = tuple("sliding" if i >= first else "full" for i in range(n))
    elif arch == "gemma2":
        kinds = tuple("sliding" if (i + 1) % 2 else "full" for i in range(n))
    elif arch == "gemma3":
        pattern = c.get("sliding_window_pattern", int, 6)
        if pattern < 1:
            raise ModelLoadError(f"{c.path}: field 'sliding_window_pattern' must be >= 1, got {pattern}")
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
    if cfg.moe is not None:
        sd = experts.hf_expert_names(sd)
    if cfg.architecture in ("gemma2", "gemma3"):  # the model's norms hold 1 + w; the file holds w
        sd = norms_plus_one(sd)
    if cfg.architecture == "phi3":  # fused qkv_proj and gate_up_proj as Llama's products
        sd = families.split_fused(sd, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
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
