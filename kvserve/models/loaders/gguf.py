"""GGUF files (llama.cpp): metadata, tensors and the tokenizer (the file itself is read by
gguf_file.GGUFFile). Matrices in Q8_0, Q4_0 and Q4_1 stay packed (models/packed.PackedWeight,
the file's own bytes); build_model keeps them packed or dequantizes them (--weight-dtype). Other
types are dequantized to fp32.

llama.cpp's converter permutes Llama Q/K rows for its interleaved RoPE; loading undoes that so
the model rotates halves like Hugging Face. Qwen2 files are stored unpermuted (NEOX RoPE).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from kvserve.config import ModelConfig
from kvserve.models.loaders.base import LoadedModel, ModelLoadError, interleaved_to_half_rope
from kvserve.models.loaders.gguf_file import GGUFFile
from kvserve.models.packed import BY_GGML_TYPE, PackedWeight
from kvserve.tokenizer.hf import HFTokenizer, from_gguf_bpe

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
PERMUTED_ARCHS = ("llama", "mistral")
LAYER_RENAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_RENAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


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
    return ModelConfig(
        layer_types=("sliding",) * int(get("block_count")) if window else (),
        sliding_window=int(window) if window else None,
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings=False, attention_bias=arch == "qwen2", architecture=arch,
        name=str(meta.get("general.name", os.path.basename(path))))


def load(path: str) -> LoadedModel:
    f = _open(path)
    meta = f.metadata
    cfg = read_config(path, meta)
    sd: dict[str, torch.Tensor] = {}
    for t in f.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        w = _packed(f, t) if t.ggml_type in BY_GGML_TYPE and len(t.shape) == 2 else f.dequantize(t)
        sd[name] = _unpermute(name, w, cfg) if cfg.architecture in PERMUTED_ARCHS else w
    tied = "lm_head.weight" not in sd
    cfg = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": tied,
                         "attention_bias": "model.layers.0.self_attn.q_proj.bias" in sd})
    return LoadedModel(cfg, sd, _tokenizer(meta, path), f"gguf:{os.path.abspath(path)}:{os.path.getsize(path)}")


def _hf_name(name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        inner = LAYER_RENAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{inner}.{m.group(3)}" if inner else None
    base, _, kind = name.rpartition(".")
    return f"{GLOBAL_RENAMES[base]}.{kind}" if base in GLOBAL_RENAMES else None


def _packed(f: GGUFFile, t: Any) -> PackedWeight:
    """The tensor's blocks as stored (a copy: the model owns its weights, not the file's map)."""
    n, k = t.shape
    data = torch.frombuffer(bytearray(f.data[t.offset:t.offset + t.nbytes]), dtype=torch.uint8)
    return PackedWeight(BY_GGML_TYPE[t.ggml_type], data.reshape(n, -1), (n, k))


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
    if kind != "gpt2":
        raise ModelLoadError(f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE "
                             f"'gpt2' is); pass --tokenizer with a tokenizer.json")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return from_gguf_bpe(
        meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
        meta.get("tokenizer.ggml.token_type", []), str(meta.get("tokenizer.ggml.pre", "gpt2")),
        None if bos is None else int(bos), eos_ids,
        bool(meta.get("tokenizer.ggml.add_bos_token", False)), meta.get("tokenizer.chat_template"))
