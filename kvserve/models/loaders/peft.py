"""Reading a PEFT LoRA adapter directory: adapter_config.json and adapter_model.safetensors.

PEFT names each low-rank pair by the module it adapts:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   A [r, in_features]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   B [out_features, r]

and the adapted module computes base(x) + scale * (x @ A^T) @ B^T, scale = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). What kvserve does not serve (DoRA, trained biases,
modules_to_save, per-module ranks, embedding or head targets) is refused by name, never ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.models.loaders.base import ModelLoadError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# settings that change the product and are not served: (key, the value that means "unused")
_UNSERVED: tuple[tuple[str, Any], ...] = (
    ("use_dora", False), ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {}),
    ("fan_in_fan_out", False), ("lora_bias", False), ("target_parameters", None),
    ("trainable_token_indices", None), ("layer_replication", None))


@dataclass
class PeftAdapter:
    """An adapter as read: its rank, scale and (A [r, in], B [out, r]) by (layer, module name)."""

    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str) -> PeftAdapter:
    """The adapter in directory `path`; ModelLoadError naming what is missing or unserved."""
    config = read_adapter_config(path)
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return PeftAdapter(path, rank, scale, _pairs(path, rank))


def read_adapter_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ModelLoadError(f"LoRA adapter {path!r} is not a directory (a PEFT adapter: {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE})")
    if not os.path.exists(file):
        raise ModelLoadError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    with open(file) as f:
        config: dict[str, Any] = json.load(f)
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ModelLoadError(f"{file}: peft_type {kind!r} is not served (only LORA)")
    unserved = [k for k, unused in _UNSERVED if config.get(k) not in (unused, None, [], {}, False)]
    if unserved:
        raise ModelLoadError(f"{file}: LoRA features not served: {', '.join(unserved)}")
    if config.get("bias", "none") != "none":
        raise ModelLoadError(f"{file}: trained biases (bias={config['bias']!r}) are not served")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise ModelLoadError(f"{file}: {key} must be a positive number, got {config.get(key)!r}")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    outside = [t for t in names if isinstance(targets, list) and t not in TARGETS]
    if outside:
        raise ModelLoadError(f"{file}: target modules not served: {outside} (served: {list(TARGETS)})")
    return config


def _pairs(path: str, rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) by (layer, module) from the safetensors file; any other tensor is refused by name."""
    from safetensors.torch import load_file
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        raise ModelLoadError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE} (only safetensors adapters are read)")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(file).items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in TARGETS:
            raise ModelLoadError(f"{file}: tensor {key!r} is not a LoRA pair of a served module "
                                 f"({', '.join(TARGETS)})")
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor.float()
    pairs = {}
    for where, ab in halves.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != rank or ab["B"].shape[1] != rank:
            shapes = {h: tuple(t.shape) for h, t in ab.items()}
            raise ModelLoadError(f"{file}: layer {where[0]} {where[1]} needs lora_A [{rank}, in] and "
                                 f"lora_B [out, {rank}], got {shapes}")
        pairs[where] = (ab["A"], ab["B"])
    if not pairs:
        raise ModelLoadError(f"{file}: no LoRA weights inside")
    return pairs
