"""Selective layer caching (--cache-layers): only some layers keep K/V; the others are recomputed
from the tokens at every step, exactly.

A layer without a cache needs, at every step, the keys and values of all its sequence's past
tokens, so its input at every past position, which every layer below it produces. The exact
scheme that follows: the leading layers, through the last one without a cache, run over every
token of each sequence (plain causal attention, no cache read or written); the layers above
them, which keep K/V, run over the step's new tokens only, taking the residual stream at the
new positions:

    layers   0 .. r-1   every token of each sequence   (recomputed: no cache)
    layers   r .. L-1   the step's new tokens          (the cache, as with every layer cached)

    a step of one decode (position 6) and one chunk (positions 0-2):
    full rows [t0 t1 t2 t3 t4 t5 t6 | c0 c1 c2] --new rows [6, 7, 8, 9]--> [t6 | c0 c1 c2]

A chosen layer below r gains nothing from a cache (its output at every past position is needed
anyway, so its queries are recomputed with its keys), so it is recomputed too and gets no
storage; the engine says so when it starts. The cost: each step runs r layers over whole
sequences, which grows with the context: the saving is memory, not time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, PrefillSpan
from kvserve.attention.layer import ForwardContext
from kvserve.config import EngineConfig, ModelConfig, chosen_cache_layers
from kvserve.core.cache_group import CacheGroupSpec
from kvserve.core.outputs import ScheduledSequence
from kvserve.kv.sizing import cached_layers_config
from kvserve.models.llama import LlamaForCausalLM, RecomputedLayers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerSelection:
    """Which layers keep K/V: the last num_layers - num_recomputed."""

    num_layers: int
    chosen: tuple[int, ...]  # what --cache-layers named, ascending

    @classmethod
    def of(cls, spec: str, num_layers: int) -> Optional["LayerSelection"]:
        """None for "all" (or a choice naming every layer); a ValueError names a bad spec, or
        one that leaves no layer cached."""
        chosen = chosen_cache_layers(spec, num_layers)
        if chosen is None or len(chosen) == num_layers:
            return None
        selection = cls(num_layers, chosen)
        if selection.num_recomputed == num_layers:
            raise ValueError(f"--cache-layers {spec!r}: the last layer ({num_layers - 1}) has no cache, so every "
                             "layer is recomputed at every step: choose the last layers, or use --no-cache")
        return selection

    @property
    def num_recomputed(self) -> int:
        """The leading layers run over whole sequences: through the last layer not chosen.
        LayerSelection(5, (0, 3, 4)).num_recomputed == 3."""
        return max(i for i in range(self.num_layers) if i not in self.chosen) + 1

    @property
    def cached(self) -> tuple[int, ...]:
        return tuple(range(self.num_recomputed, self.num_layers))

    @property
    def recomputed_though_chosen(self) -> tuple[int, ...]:
        """Chosen layers below an unchosen one: recomputed all the same, without storage."""
        return tuple(i for i in self.chosen if i < self.num_recomputed)

    def layer_to_tensor(self) -> tuple[Optional[int], ...]:
        """The storage's tensor set of each layer (None: no cache). (5, (3, 4)) -> (None,) * 3 + (0, 1)."""
        r = self.num_recomputed
        return tuple(None if i < r else i - r for i in range(self.num_layers))

    def describe(self) -> str:
        kept = (f"layers {self.cached[0]}..{self.cached[-1]} of {self.num_layers} keep" if len(self.cached) > 1
                else f"layer {self.cached[0]} of {self.num_layers} keeps")
        text = f"{kept} K/V; layers 0..{self.num_recomputed - 1} are recomputed each step"
        if self.recomputed_though_chosen:
            text += (f" (chosen layers {list(self.recomputed_though_chosen)} lie below unchosen layer "
                     f"{self.num_recomputed - 1}, whose past K/V need their outputs at every position: "
                     "they are recomputed too and hold no cache)")
        return text


def check_model(model: LlamaForCausalLM) -> None:
    """The split runs through LlamaForCausalLM.forward; a family with its own forward is refused."""
    if type(model).forward is not LlamaForCausalLM.forward:
        raise ValueError(f"--cache-layers is not offered for {model.config.name} ({type(model).__name__} has its "
                         "own forward pass, which does not split the layers)")


def recomputed_layers(seqs: Sequence[ScheduledSequence], num_layers: int, backend: AttentionBackend,
                      device: torch.device) -> RecomputedLayers:
    """The whole sequences of the step's sequences (in the step's order) for the first num_layers
    layers, and the rows of the step's new tokens among them."""
    ids: list[int] = []
    positions: list[int] = []
    new_rows: list[int] = []
    meta = AttentionMetadata()
    for s in seqs:
        known = s.start_position + len(s.input_token_ids)
        tokens = (list(s.prompt_token_ids) + list(s.output_token_ids))[:known] + s.spec_token_ids
        meta.prefills.append(PrefillSpan(len(ids), len(tokens), len(tokens)))
        new_rows += range(len(ids) + s.start_position, len(ids) + len(tokens))
        ids += tokens
        positions += range(len(tokens))
    ctx = ForwardContext(None, [backend.build_metadata(meta, None)])
    return RecomputedLayers(num_layers, torch.tensor(ids, dtype=torch.long, device=device),
                            torch.tensor(positions, dtype=torch.long, device=device),
                            torch.tensor(new_rows, dtype=torch.long, device=device), ctx)


def select_cache_layers(config: EngineConfig, model: ModelConfig,
                        groups: Sequence[CacheGroupSpec]) -> Optional[LayerSelection]:
    """The engine's --cache-layers, checked against what it runs beside: what the split cannot
    serve is refused by name."""
    selection = LayerSelection.of(config.cache.cache_layers, model.num_hidden_layers)
    if selection is None:
        return None
    refusals = [(not config.use_cache, "--no-cache (which recomputes every layer)"),
                (config.parallel.tensor_parallel_size > 1, "tensor parallelism"),
                (config.speculative.method is not None, "speculative decoding"),
                (config.lora.enable_lora or bool(config.lora.modules), "LoRA adapters"),
                (model.mla is not None, f"{model.name}'s latent attention (MLA)"),
                (len(groups) > 1 or any(g.window is not None for g in groups), "sliding windows")]
    for refused, what in refusals:
        if refused:
            raise ValueError(f"--cache-layers {config.cache.cache_layers!r} cannot be combined with {what}: "
                             "selective layer caching serves full attention on one rank only")
    return selection


def cache_view(selection: Optional[LayerSelection], model: ModelConfig,
               layer_tensor: Sequence[int]) -> tuple[ModelConfig, Sequence[Optional[int]]]:
    """What the cache is sized and allocated for (the model as its cached layers see it) and
    each layer's tensor set in the storage (None: no cache)."""
    if selection is None:
        return model, layer_tensor
    logger.info("--cache-layers: %s", selection.describe())
    if selection.recomputed_though_chosen:
        logger.warning("--cache-layers: chosen layers %s hold no cache: %s", list(selection.recomputed_though_chosen),
                       selection.describe())
    return cached_layers_config(model, len(selection.cached)), selection.layer_to_tensor()


def cached_layers_key(selection: Optional[LayerSelection]) -> tuple[str, ...]:
    """What the prefix cache's hashes add under --cache-layers (a block holds only those layers,
    so it must never match a block of another selection, in a tier on disk or a peer's handover);
    nothing for every layer, so the hashes of a full cache stay as they were."""
    if selection is None:
        return ()
    return (f"cache_layers:{selection.cached[0]}-{selection.cached[-1]}",)
