"""LoRA adapters applied per row of a mixed batch.

A batch may hold rows of the base model and rows of several adapters at once. Every linear an
adapter can target is wrapped once, when LoRA is enabled (`LoRASet(model)`), by a `LoRALinear`
that computes the base product and then, for each adapter in the step, adds to that adapter's
rows only:

    y[rows, start:end] += scale * (x[rows] @ A^T) @ B^T        A [r, in], B [out, r]

Where the model fuses products (q|k|v, gate|up: kvserve.models.packed.fuse) the wrapper sits on
the fused product and each adapted module's delta lands on its columns [start, end) of it:

    fused q|k|v product   [ q: 0 .. Hq*D | k: .. + Hkv*D | v: .. + Hkv*D ]
                            ^ q_proj's delta ^ k_proj's      ^ v_proj's

The runner says before each forward which rows run which adapter (`begin_step`) and clears it
after (`end_step`); with no adapter rows a wrapper costs one call. Without LoRA enabled nothing
is wrapped, so a model that serves no adapters runs exactly as before.
"""

from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from kvserve.core.sampling_params import SamplingParams
from kvserve.models.loaders.base import ModelLoadError
from kvserve.models.loaders.peft import read_adapter
from kvserve.models.packed import FusedPart
from kvserve.modules import DirectCall

Pair = tuple[torch.Tensor, torch.Tensor]  # A [r, in], B [out, r]
Site = tuple[int, str]  # (layer index, module name): where an adapter's pair applies


class LoRAError(ValueError):
    """An adapter that cannot be loaded, named or unloaded (the message names it)."""


@dataclass
class LoRAAdapter:
    name: str
    lora_id: int  # unique for every load, never reused: what the block hashes carry
    path: str
    rank: int
    scale: float
    weights: dict[Site, Pair]  # in the model's dtype and device
    products: dict[tuple[int, tuple[str, ...]], Pair]  # by wrapper key: its parts' pairs stacked (stack_pairs)


class LoRALinear(DirectCall, nn.Module):
    """A product (one linear, or a fused group's) and the adapters' deltas on their columns."""

    def __init__(self, base: nn.Module, layer_idx: int, parts: list[tuple[str, int, int]], owner: "LoRASet") -> None:
        super().__init__()
        self.base = base
        self.layer_idx = layer_idx
        self.parts = parts  # (module name, first column, one past the last) in the product
        self.key = (layer_idx, tuple(name for name, _, _ in parts))
        # not a submodule, and held weakly: the set holds its wrappers, and a cycle would keep a
        # dropped engine's model until a collection (a wrapper whose set is gone adds nothing)
        self.owner = weakref.ref(owner)
        self.in_features, self.out_features = base.in_features, base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.forward(x)  # [T, out]
        owner = self.owner()
        for adapter, rows in owner.step if owner is not None else ():  # empty without adapter rows
            pair = adapter.products.get(self.key)
            if pair is None:
                continue
            if rows is None:  # every row of the step runs this adapter
                y.add_((x @ pair[0].t()) @ pair[1].t(), alpha=adapter.scale)
            else:
                delta = (x.index_select(0, rows) @ pair[0].t()) @ pair[1].t()  # [R, out]
                y.index_add_(0, rows, delta, alpha=adapter.scale)
        return y  # type: ignore[no-any-return]


def stack_pairs(weights: dict[Site, Pair], wrapper: LoRALinear) -> Optional[Pair]:
    """The pairs of a wrapper's parts as one: A of every adapted part stacked [sum r, in], and B
    placed block-diagonally [out, sum r] on each part's columns (zero where a part is not adapted),
    so a fused product's delta is two products and one add. None: no part adapted."""
    found = [(weights[(wrapper.layer_idx, n)], start, end) for n, start, end in wrapper.parts
             if (wrapper.layer_idx, n) in weights]
    if not found:
        return None
    a = torch.cat([pair[0] for pair, _, _ in found])
    b = a.new_zeros(wrapper.out_features, a.shape[0])
    col = 0
    for (_, part_b), start, end in found:
        b[start:end, col:col + part_b.shape[1]] = part_b
        col += part_b.shape[1]
    return a, b


class LoRASet:
    """The adapters a model serves, by name, and which rows of the step run which adapter."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int) -> None:
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        # (adapter, its rows [R], None: all of them) in this forward
        self.step: list[tuple[LoRAAdapter, Optional[torch.Tensor]]] = []
        self.dtype, self.device = model.dtype, model.device
        self.sites = wrap_targets(model, self)  # (layer, module) -> (in_features, out_features)
        self.wrappers = [m for m in model.modules() if isinstance(m, LoRALinear)]
        self._ids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read the PEFT adapter at path and serve it as `name`; LoRAError naming the problem."""
        if name in self.adapters:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded (from {self.adapters[name].path})")
        if len(self.adapters) >= self.max_loras:
            raise LoRAError(f"{len(self.adapters)} LoRA adapters are loaded, the most max_loras allows: "
                            "unload one first")
        try:
            peft = read_adapter(path)
        except (ModelLoadError, OSError, ValueError) as e:
            raise LoRAError(f"LoRA adapter {name!r}: {e}") from None
        if peft.rank > self.max_lora_rank:
            raise LoRAError(f"LoRA adapter {name!r} has rank {peft.rank}, above max_lora_rank {self.max_lora_rank}")
        self._check_sites(name, peft.weights)
        weights = {site: (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
                   for site, (a, b) in peft.weights.items()}
        products = {w.key: pair for w in self.wrappers if (pair := stack_pairs(weights, w)) is not None}
        adapter = LoRAAdapter(name, next(self._ids), os.path.abspath(path), peft.rank, peft.scale, weights, products)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        if name not in self.adapters:
            raise LoRAError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters)}")
        return self.adapters.pop(name)

    def begin_step(self, rows: Sequence[tuple[Optional[str], int]]) -> None:
        """The step's rows, per sequence in batch order: (its adapter's name or None, its rows)."""
        by_adapter: dict[str, list[int]] = {}
        start = 0
        for name, count in rows:
            if name is not None:
                by_adapter.setdefault(name, []).extend(range(start, start + count))
            start += count
        self.step = [(self.adapters[name], None if len(index) == start else
                      torch.tensor(index, dtype=torch.long, device=self.device)) for name, index in by_adapter.items()]

    def end_step(self) -> None:
        self.step = []

    def _check_sites(self, name: str, weights: dict[Site, Pair]) -> None:
        """Every pair must adapt a wrapped module of matching shape."""
        for (layer, module), (a, b) in sorted(weights.items()):
            shape = self.sites.get((layer, module))
            if shape is None:
                raise LoRAError(f"LoRA adapter {name!r} targets layer {layer} {module}, which this model "
                                "has not (or serves no adapter on)")
            if (a.shape[1], b.shape[0]) != shape:
                raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} maps {a.shape[1]} -> {b.shape[0]} "
                                f"features, the model's {shape[0]} -> {shape[1]}")


def lora_name(params: SamplingParams) -> Optional[str]:
    """The adapter a request's rows run (None: the base model)."""
    return None if params.lora_request is None else params.lora_request.lora_name


ATTENTION = ("fused_qkv", ("q_proj", "k_proj", "v_proj"), "o_proj")
MLP = ("fused_gate_up", ("gate_proj", "up_proj"), "down_proj")


def wrap_targets(model: nn.Module, owner: LoRASet) -> dict[Site, tuple[int, int]]:
    """Wrap every adaptable product of every decoder layer (a fused group once, on its fused
    product); returns the sites by (layer, module) with their (in, out) features."""
    sites: dict[Site, tuple[int, int]] = {}
    for i, layer in enumerate(model.model.layers):
        for block_name, (group, fused_names, single) in (("self_attn", ATTENTION), ("mlp", MLP)):
            block = getattr(layer, block_name, None)
            if block is None:
                continue
            fused = getattr(block, group, None)
            if fused is not None:
                _wrap_fused(fused, fused_names, i, owner, sites)
            else:
                for n in fused_names:
                    _wrap_one(block, n, i, owner, sites)
            _wrap_one(block, single, i, owner, sites)
    return sites


def _wrap_fused(group: nn.Module, names: tuple[str, ...], layer: int, owner: LoRASet,
                sites: dict[Site, tuple[int, int]]) -> None:
    parts, start = [], 0
    for n, size in zip(names, group.sizes):
        parts.append((n, start, start + size))
        sites[(layer, n)] = (group.fused.in_features, size)
        start += size
    group.fused = LoRALinear(group.fused, layer, parts, owner)


def _wrap_one(block: nn.Module, name: str, layer: int, owner: LoRASet, sites: dict[Site, tuple[int, int]]) -> None:
    module = getattr(block, name, None)
    # a FusedPart's group product is wrapped instead
    if module is None or isinstance(module, (LoRALinear, FusedPart)) or not hasattr(module, "out_features"):
        return
    sites[(layer, name)] = (module.in_features, module.out_features)
    setattr(block, name, LoRALinear(module, layer, [(name, 0, module.out_features)], owner))
