"""GGUF files (llama.cpp): metadata, tensors and the tokenizer (the file itself is read by
gguf_file.GGUFFile). Matrices in Q8_0, Q4_0 and Q4_1 stay packed (models/packed.PackedWeight,
the file's own bytes); build_model keeps them packed or dequantizes them (--weight-dtype). F16
and BF16 tensors load as torch float16 / bfloat16 (build_model casts them to the model's dtype, as
it casts a Hugging Face checkpoint's); other types are dequantized to fp32.

llama.cpp's converter permutes Llama Q/K rows for its interleaved RoPE; loading undoes that so
the model rotates halves like Hugging Face. Qwen2 files are stored unpermuted (NEOX RoPE).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import torch

from kvserve.config import ModelConfig
from kvserve.models.loaders import experts, families, gguf_deepseek
from kvserve.models.loaders.base import LoadedModel, ModelLoadError, interleaved_to_half_rope
from kvserve.models.loaders.gguf_file import GGUFFile
from kvserve.models.loaders.gguf_gemma import GEMMA_ARCHS, GGUF_LAYER_RENAMES, gemma_fields
from kvserve.models.packed import BY_GGML_TYPE, PackedWeight
from kvserve.tokenizer.hf import GEMMA_STYLE, PHI3_STYLE, HFTokenizer, SpmStyle, from_gguf_bpe, from_gguf_spm

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral", *experts.GGUF_MOE_ARCHS, *families.GGUF_ARCHS, *GEMMA_ARCHS,
                   gguf_deepseek.ARCH)
PERMUTED_ARCHS = ("llama", "mistral", "mixtral", *families.GGUF_PERMUTED)  # kvserve's names (llama.cpp's llama with experts: mixtral)
LAYER_RENAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", **experts.GGUF_LAYER_RENAMES,
}
ARCH_LAYER_RENAMES = {**families.GGUF_LAYER_RENAMES, **{a: GGUF_LAYER_RENAMES for a in GEMMA_ARCHS},
                      **{a: gguf_deepseek.GGUF_LAYER_RENAMES for a in ("deepseek_v2", "deepseek_v3")}}
GLOBAL_RENAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SPM_STYLES: dict[str, SpmStyle] = {**dict.fromkeys(GEMMA_ARCHS, GEMMA_STYLE), "phi3": PHI3_STYLE}  # 'llama' vocabularies


def _open(path: str) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e


def read_config(path: str, meta: dict[str, Any] | None = None) -> ModelConfig:
    meta = meta if meta is not None else _open(path).metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHS}")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = int(get("vocab_size", len(meta.get("tokenizer.ggml.tokens", ()))))
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    window = get("attention.sliding_window")  # llama.cpp writes it for Mistral and windowed Qwen2
    moe = experts.gguf_moe_config(get, arch, int(get("block_count")), int(get("feed_forward_length")))
    cfg = ModelConfig(
        layer_types=("sliding",) * int(get("block_count")) if window else (),
        sliding_window=int(window) if window else None,
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings=False, attention_bias=arch == "qwen2", moe=moe,
        architecture=experts.GGUF_MOE_ARCHS.get(arch, "mixtral" if moe else arch),
        **families.gguf_fields(get, arch, int(get("attention.key_length", hidden // heads)), int(get("block_count"))),
        name=str(meta.get("general.name", os.path.basename(path))))
    if arch == gguf_deepseek.ARCH:  # latent attention, DeepSeek's routing (kvserve.models.loaders.gguf_deepseek)
        cfg = dataclasses.replace(cfg, **gguf_deepseek.config_fields(get, path, int(get("block_count"))))
    return dataclasses.replace(cfg, **gemma_fields(get, arch, path)) if arch in GEMMA_ARCHS else cfg


def load(path: str) -> LoadedModel:
    f = _open(path)
    meta = f.metadata
    cfg = read_config(path, meta)
    tokenizer = _tokenizer(meta, path)  # first: a large vocabulary builds while the tensors load
    sd: dict[str, torch.Tensor] = {}
    latent: dict[str, torch.Tensor] = {}  # MLA's kv_b pieces and router biases, joined after the loop
    for t in f.tensors:
        if cfg.mla is not None and gguf_deepseek.is_latent_tensor(t.name):
            latent[t.name] = f.dequantize(t)
            continue
        split = experts.gguf_experts(t.name, t.shape, t.ggml_type, lambda t=t: _raw(f, t)
                                     if t.ggml_type in BY_GGML_TYPE else f.dequantize(t))
        if split is not None:
            sd.update(split)
            continue
        name = _hf_name(t.name, cfg.architecture)
        if name is None:
            continue
        w = _packed(f, t) if t.ggml_type in BY_GGML_TYPE and len(t.shape) == 2 else f.floats(t)
        sd[name] = _unpermute(name, w, cfg) if cfg.architecture in PERMUTED_ARCHS else w
    if cfg.mla is not None:
        sd.update(gguf_deepseek.latent_tensors(latent, cfg))
    tied = "lm_head.weight" not in sd
    sd = experts.shared_expert_gate(sd)
    if cfg.architecture == "phi3":  # attn_qkv and ffn_up (gate | up) as Llama's products; longrope
        sd = families.split_fused(sd, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        longrope = families.gguf_longrope(path, lambda key, default=None: meta.get(f"phi3.{key}", default),
                                          cfg.rotary_dim, {t.name: f.dequantize(t) for t in f.tensors
                                                           if t.name.startswith("rope_factors_")})
        cfg = ModelConfig(**{**cfg.__dict__, "rope_scaling": longrope or cfg.rope_scaling})
    cfg = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": tied,
                         "attention_bias": "model.layers.0.self_attn.q_proj.bias" in sd})
    return LoadedModel(cfg, sd, tokenizer, f"gguf:{os.path.abspath(path)}:{os.path.getsize(path)}")


def _hf_name(name: str, arch: str = "llama") -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        inner = ARCH_LAYER_RENAMES.get(arch, {}).get(m.group(2)) or LAYER_RENAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{inner}.{m.group(3)}" if inner else None
    base, _, kind = name.rpartition(".")
    return f"{GLOBAL_RENAMES[base]}.{kind}" if base in GLOBAL_RENAMES else None


def _packed(f: GGUFFile, t: Any) -> PackedWeight:
    """The tensor's blocks as stored (a copy: the model owns its weights, not the file's map)."""
    n, k = t.shape
    return PackedWeight(BY_GGML_TYPE[t.ggml_type], _raw(f, t).reshape(n, -1), (n, k))


def _raw(f: GGUFFile, t: Any) -> torch.Tensor:
    """The tensor's bytes, uint8 (a copy)."""
    return torch.frombuffer(bytearray(f.data[t.offset:t.offset + t.nbytes]), dtype=torch.uint8)


def _unpermute(name: str, w: Any, cfg: ModelConfig) -> Any:
    """Q/K rows back from interleaved RoPE pairs; a packed weight's rows move whole."""
    heads = cfg.num_attention_heads if ".self_attn.q_proj." in name else \
        cfg.num_key_value_heads if ".self_attn.k_proj." in name else None
    if heads is None:
        return w
    if isinstance(w, PackedWeight):
        order = interleaved_to_half_rope(torch.arange(w.shape[0]), heads)
        return w.take_rows(order)
    return interleaved_to_half_rope(w, heads)


def _tokenizer(meta: dict[str, Any], path: str) -> HFTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE "
                             f"'gpt2' and sentencepiece-style 'llama' are); pass --tokenizer with a tokenizer.json")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if kind == "llama":
        return _spm_tokenizer(meta, path, None if bos is None else int(bos), eos_ids)
    return from_gguf_bpe(
        meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
        meta.get("tokenizer.ggml.token_type", []), str(meta.get("tokenizer.ggml.pre", "gpt2")),
        None if bos is None else int(bos), eos_ids,
        bool(meta.get("tokenizer.ggml.add_bos_token", False)), meta.get("tokenizer.chat_template"))


def _spm_tokenizer(meta: dict[str, Any], path: str, bos: int | None, eos_ids: list[int]) -> HFTokenizer:
    """A sentencepiece-style vocabulary read as its family writes it (hf.SpmStyle): Gemma's (no
    prefix space, merges in the vocabulary's order) and Phi-3's (a prefix space, merges ranked by
    score, its special tokens swallowing the whitespace after them, as llama.cpp reads them).
    Other families' ('llama' files of Llama 2, Mistral) are refused rather than encoded in a way
    not checked against their model's tokenizer."""
    arch = meta.get("general.architecture")
    style = SPM_STYLES.get(str(arch))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if style is None or (style is GEMMA_STYLE and prefix):
        raise ModelLoadError(f"{path}: the sentencepiece-style vocabulary of a {arch!r} file is not supported "
                             f"({sorted(SPM_STYLES)} are); pass --tokenizer with a tokenizer.json")
    if style.add_space_prefix != prefix:
        style = dataclasses.replace(style, add_space_prefix=prefix)
    return from_gguf_spm(meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type", []), bos, eos_ids,
                         bool(meta.get("tokenizer.ggml.add_bos_token", True)), meta.get("tokenizer.chat_template"),
                         style, meta.get("tokenizer.ggml.scores"))
