"""KV storage: the object that owns a cache's tensors and every way they are read and moved.

    plan_writes(slots)               once per step and cache group: where the step's K/V go
    write(layer, k, v, plan)         the step's new K/V into their slots (quantized on the way in)
    gather(layer, tables, n)         whole blocks as dense K/V, for the torch path (dequantized:
                                     only the blocks gathered, never the whole cache)
    layer_tensors(layer)             what a kernel reads in place
    copy_blocks(pairs)               copy-on-write inside the cache
    swap_out(dst, pairs), swap_in    blocks to another storage of the same kind (the CPU pool)
    release(blocks)                  blocks nobody holds any more (per-block state is dropped)
    bytes_per_block, nbytes          the memory it holds, counted exactly

The attention backends talk to this interface, so a cache that stores K/V another way is a new
class here, not a branch in attention.

Every storage keeps named tensors whose first dimension is the block (BlockTensorStorage): a
copy or swap moves the same rows of all of them. Tensor set j holds the j-th layer of every
cache group (see kvserve.core.cache_group), so a block id names one row of each, used by the
group holding the block. The last block is the null block.

    DenseKVStorage   k, v [nb, bs, kvh, hd] in the cache dtype
    Int8KVStorage    k, v int8 and a fp32 scale per token and head [nb, bs, kvh]
    Fp8KVStorage     k, v fp8 codes; fixed fp32 scales per layer and head
    Int4KVStorage    k, v packed [nb, bs, kvh, hd/2]; K scale/zero per channel [nb, kvh, hd],
                     V scale/zero per token [nb, bs, kvh]; the open (partly filled) block of each
                     sequence in full precision in a residual slot until it fills
"""

from __future__ import annotations

import functools
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from kvserve import kernels
from kvserve.kv import quant

BlockPairs = Sequence[tuple[int, int]]


class KVStorage(ABC):
    num_blocks: int  # physical blocks, the null block included
    block_size: int
    kind: str = "dense"

    @property
    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes one block id holds, over every tensor (all layers of the group using it)."""

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def populate(self) -> None:
        """Write every page of the storage's CPU memory now, with the zeros it holds, so that no
        step waits for the OS to hand a page over on its first write (`--kv-cache-populate`).
        A storage on another device was written when it was made: nothing to do."""

    def begin_step(self) -> None:
        """A new step starts: its writes will be planned next."""

    def plan_writes(self, slot_mapping: torch.Tensor) -> Any:
        """Once per step and cache group, before any layer writes: what `write` needs to know
        beyond the slots (the slot mapping itself, for most storages)."""
        return slot_mapping

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: Any) -> None:
        """k, v [T, kv_heads, head_dim] into the slots the plan holds, in the layer."""

    @abstractmethod
    def gather(self, layer: int, block_tables: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., nb] block ids -> K, V [..., nb * num_slots, kv_heads, head_dim] (the first
        num_slots slots of each block) in fp32 or the cache's float dtype."""

    @abstractmethod
    def layer_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's tensors as stored, for kernels that read blocks in place."""

    @abstractmethod
    def decode_operands(self, layer: int) -> tuple[Any, ...]:
        """What a decode kernel reads of the layer, in the order the kernel of this storage's
        `kind` takes them after q (the attention backend chooses the kernel by kind)."""

    def fixed_decode(self, layer: int) -> Optional[tuple[Callable[..., Any], tuple[Any, ...]]]:
        """(write, operands) for a layer whose tensors stay where they are: write(plan, k, v) does
        what write(layer, k, v, plan) does in one compiled call, and operands are
        decode_operands(layer). A fast path settles them once. None (the default): ask write and
        decode_operands at each call (a storage whose tensors grow, or without the kernel)."""
        return None

    def fixed_store(self, layer: int) -> Optional[tuple[str, tuple[torch.Tensor, ...]]]:
        """For a layer whose tensors stay where they are and which one layer_ops function writes:
        that function's name and the tensors it takes before (slots, k, v), the call fixed_decode's
        write makes, for a kernel that calls it itself. None (the default): no such function."""
        return None

    @abstractmethod
    def copy_blocks(self, pairs: BlockPairs) -> None:
        """dst block := src block (copy-on-write)."""

    @abstractmethod
    def swap_out(self, dst: "KVStorage", pairs: BlockPairs) -> None:
        """dst's block b := this storage's block a, for each (a, b) (to the CPU pool)."""

    def swap_in(self, src: "KVStorage", pairs: BlockPairs) -> None:
        """This storage's block b := src's block a, for each (a, b) (back from the CPU pool)."""
        src.swap_out(self, pairs)

    def release(self, block_ids: Sequence[int]) -> None:
        """Blocks nobody holds any more; a storage with per-block state drops it."""

    # ---- what a multi-token chunk attends to ----
    def reads_back_as(self) -> Optional[torch.dtype]:
        """The dtype whose cast (`.to(dtype)`) of the K/V written is exactly what reading them
        back gives (a chunk that starts its sequence then attends to its fresh K/V so cast,
        without reading the cache), or None: a quantized format gives back something else."""
        return None

    def reads_back_exactly(self, dtype: torch.dtype) -> bool:
        """Whether K/V read back equal K/V written (in `dtype`)."""
        return self.reads_back_as() == dtype

    def chunk_view(self, start: int, q_len: int, device: torch.device) -> ChunkView:
        """Once per step and chunk: which version of each K/V the chunk's queries see. A query
        sees the cache as it is right after its own K/V was written, whichever step wrote the
        rest, so a prompt gets the same numbers prefilled whole, in chunks, after a prefix-cache
        hit or token by token. Here: the cache's K/V of every earlier position and its own.
        (Windows and sinks narrow this by key position, in the backend.)"""
        q_pos = torch.arange(start, start + q_len, device=device).unsqueeze(1)
        k_pos = torch.arange(start + q_len, device=device)
        return ChunkView(k_pos.unsqueeze(0) <= q_pos, key_positions=k_pos, causal=True)

    def chunk_context(self, layer: int, block_table: torch.Tensor, start: int, k: torch.Tensor,
                      v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a chunk's view indexes: [S, kvh, hd] each (k, v: the chunk's own)."""
        context_len = start + k.shape[0]
        keys, values = self.gather(layer, block_table, min(self.block_size, context_len))
        return keys[:context_len], values[:context_len]


@dataclass
class ChunkView:
    """What a chunk's queries attend to: columns of keys (from chunk_context, or the chunk's
    own fresh K/V), each at a position."""

    mask: torch.Tensor  # [q_len, S] bool: True where a query attends to key i
    from_cache: bool = True  # keys from chunk_context; False: the chunk's own fresh K/V
    key_positions: Optional[torch.Tensor] = None  # [S] the position of each key column
    read_from: int = 0  # the first table entry chunk_context reads (the ones before: outside every window)
    num_sinks: int = 0  # columns of sink keys (positions 0..num_sinks-1) put before the context
    sink_columns: Optional[torch.Tensor] = None  # [S] bool: keys scored from the query's rank (sinks)
    # the mask is plain causal: keys at positions 0..S-1, the chunk's queries the last q_len of
    # them, each seeing every key up to its own (a kernel needs no mask to attend so)
    causal: bool = False


class BlockTensorStorage(KVStorage):
    """Named tensors per layer-tensor set, each [num_blocks, ...]."""

    # the layer_ops function that writes a layer's K/V in one call on CPU (None: none), and the
    # tensors it writes, in the order it takes them before (slots, k, v)
    store_kernel: Optional[str] = None
    store_parts: tuple[str, ...] = ()

    def __init__(self, layer_to_tensor: Sequence[Optional[int]], num_blocks: int, block_size: int,
                 parts: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device | str) -> None:
        self.layer_to_tensor = list(layer_to_tensor)  # None: a layer without a cache (--cache-layers)
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self.parts = parts
        num_sets = max(t for t in self.layer_to_tensor if t is not None) + 1
        self.tensors = [{name: zeros((num_blocks, *shape), dtype, device) for name, (shape, dtype) in parts.items()}
                        for _ in range(num_sets)]
        self.ops = kernels.load("layer_ops") if self.store_kernel and self.device.type == "cpu" else None

    def kernel_write(self, layer: int) -> Optional[Callable[..., Any]]:
        """write(plan, k, v) into the layer's tensors in one compiled call, or None: no kernel."""
        if self.ops is None:
            return None
        t = self.layer_tensors(layer)
        store = getattr(self.ops, self.store_kernel)
        return functools.partial(store, *(t[name] for name in self.store_parts))

    def fixed_decode(self, layer: int) -> Optional[tuple[Callable[..., Any], tuple[Any, ...]]]:
        """The kernel's write into this layer, made once (its tensors never move), and its operands."""
        if self.ops is None or self.layer_to_tensor[layer] is None:
            return None
        return self.kernel_write(layer), self.decode_operands(layer)  # type: ignore[return-value]

    def fixed_store(self, layer: int) -> Optional[tuple[str, tuple[torch.Tensor, ...]]]:
        if self.ops is None or self.layer_to_tensor[layer] is None or self.store_kernel is None:
            return None
        t = self.layer_tensors(layer)
        return self.store_kernel, tuple(t[name] for name in self.store_parts)

    @property
    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for tensors in self.tensors for t in tensors.values())

    def populate(self) -> None:
        if self.device.type == "cpu":
            for tensors in self.tensors:
                for t in tensors.values():
                    t.zero_()  # zeros over zeros: the values stay, the pages arrive

    def layer_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        tensor = self.layer_to_tensor[layer]
        if tensor is None:
            raise ValueError(f"layer {layer} keeps no K/V in this cache (--cache-layers): it is recomputed")
        return self.tensors[tensor]

    def copy_blocks(self, pairs: BlockPairs) -> None:
        if not pairs:
            return
        src, dst = _index(pairs, self.device)
        for tensors in self.tensors:
            for t in tensors.values():
                t[dst] = t[src]

    def read_block(self, block_id: int) -> torch.Tensor:
        """A copy of one block's rows of every tensor, as bytes [bytes_per_block] uint8 on the CPU
        (what a tier below the pool keeps of an evicted block)."""
        rows = [t[block_id].reshape(-1).view(torch.uint8) for tensors in self.tensors for t in tensors.values()]
        return torch.cat(rows).cpu()

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """The block's rows := bytes read_block returned (of a storage with the same parts)."""
        if data.numel() != self.bytes_per_block:
            raise ValueError(f"a block of this cache holds {self.bytes_per_block} bytes, got {data.numel()}")
        offset = 0
        for tensors in self.tensors:
            for t in tensors.values():
                n = t[block_id].numel() * t.element_size()
                t[block_id] = data[offset:offset + n].to(t.device).view(t.dtype).view(t.shape[1:])
                offset += n

    def swap_out(self, dst: KVStorage, pairs: BlockPairs) -> None:
        if not pairs:
            return
        assert isinstance(dst, BlockTensorStorage) and dst.parts == self.parts, "swap between like storages"
        src_idx, dst_idx = _index(pairs, self.device)
        dst_idx = dst_idx.to(dst.device)
        for mine, theirs in zip(self.tensors, dst.tensors):
            for name, t in mine.items():
                theirs[name][dst_idx] = t[src_idx].to(dst.device, non_blocking=True)


class DenseKVStorage(BlockTensorStorage):
    """K and V as they are computed, block-major: each block's tokens are contiguous, so
    gathering a sequence's context is one index over its block table (whole blocks, not single
    slots)."""

    store_kernel, store_parts = "store_kv", ("k", "v")

    def __init__(self, layer_to_tensor: Sequence[int], num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (block_size, num_kv_heads, head_dim)
        super().__init__(layer_to_tensor, num_blocks, block_size, {"k": (shape, dtype), "v": (shape, dtype)}, device)
        self.dtype = dtype

    @property
    def k(self) -> list[torch.Tensor]:
        return [t["k"] for t in self.tensors]

    @property
    def v(self) -> list[torch.Tensor]:
        return [t["v"] for t in self.tensors]

    def reads_back_as(self) -> Optional[torch.dtype]:
        return self.dtype  # a write stores .to(dtype) (store_kv converts as it does; index_put_ elsewhere)

    def decode_operands(self, layer: int) -> tuple[Any, ...]:
        t = self.layer_tensors(layer)
        return t["k"], t["v"]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: Any) -> None:
        store = self.kernel_write(layer)
        if store is not None:  # K and V of any float dtypes and layouts, converted as .to() converts
            store(plan, k, v)
            return
        t = self.layer_tensors(layer)
        t["k"].view(-1, *k.shape[1:]).index_put_((plan,), k.to(self.dtype))
        t["v"].view(-1, *v.shape[1:]).index_put_((plan,), v.to(self.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.layer_tensors(layer)
        return _gather(t["k"], block_tables, num_slots), _gather(t["v"], block_tables, num_slots)


class Int8KVStorage(BlockTensorStorage):
    kind = "int8"
    store_kernel, store_parts = "store_kv_int8", ("k", "k_scale", "v", "v_scale")

    def __init__(self, layer_to_tensor: Sequence[int], num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, device: torch.device | str) -> None:
        values, scales = (block_size, num_kv_heads, head_dim), (block_size, num_kv_heads)
        super().__init__(layer_to_tensor, num_blocks, block_size,
                         {"k": (values, torch.int8), "k_scale": (scales, torch.float32),
                          "v": (values, torch.int8), "v_scale": (scales, torch.float32)}, device)

    def decode_operands(self, layer: int) -> tuple[Any, ...]:
        t = self.layer_tensors(layer)
        return t["k"], t["k_scale"], t["v"], t["v_scale"]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: Any) -> None:
        store = self.kernel_write(layer)
        if store is not None:  # quantize_int8 and the two writes, bit for bit, in one call
            store(plan, k, v)
            return
        t = self.layer_tensors(layer)
        for name, x in (("k", k), ("v", v)):
            q, scale = quant.quantize_int8(x)
            t[name].view(-1, *q.shape[1:]).index_put_((plan,), q)
            t[f"{name}_scale"].view(-1, scale.shape[1]).index_put_((plan,), scale)

    def gather(self, layer: int, block_tables: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.layer_tensors(layer)
        return tuple(quant.dequantize_int8(_gather(t[n], block_tables, num_slots),  # type: ignore[return-value]
                                           _gather(t[f"{n}_scale"], block_tables, num_slots)) for n in ("k", "v"))


class Fp8KVStorage(BlockTensorStorage):
    """fp8 codes with a fixed scale per layer and KV head ([layers, 2, kvh]: K then V), set once
    (`set_scales`) before anything is written; values beyond the format saturate."""

    def __init__(self, layer_to_tensor: Sequence[int], num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, device: torch.device | str, fmt: str) -> None:
        values = (block_size, num_kv_heads, head_dim)
        super().__init__(layer_to_tensor, num_blocks, block_size,
                         {"k": (values, torch.uint8), "v": (values, torch.uint8)}, device)
        self.kind, self.format = "fp8", fmt
        self.scales = torch.ones(len(self.layer_to_tensor), 2, num_kv_heads, device=self.device)
        self.table = quant.fp8_table(fmt).to(self.device)

    def set_scales(self, scales: torch.Tensor) -> None:
        if scales.shape != self.scales.shape or not bool((scales > 0).all()):
            raise ValueError(f"fp8 kv scales must be positive, shaped [layers, 2, kv_heads] = "
                             f"{list(self.scales.shape)}, got {list(scales.shape)}")
        self.scales = scales.float().to(self.device)

    def decode_operands(self, layer: int) -> tuple[Any, ...]:
        t = self.layer_tensors(layer)
        return t["k"], t["v"], self.table, self.scales[layer, 0], self.scales[layer, 1], self.format == "fp8_e4m3"

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: Any) -> None:
        t = self.layer_tensors(layer)
        for i, (name, x) in enumerate((("k", k), ("v", v))):
            codes = quant.quantize_fp8(x, self.scales[layer, i], self.format)
            t[name].view(-1, *codes.shape[1:]).index_put_((plan,), codes)

    def gather(self, layer: int, block_tables: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.layer_tensors(layer)
        return tuple(quant.dequantize_fp8(_gather(t[n], block_tables, num_slots), self.scales[layer, i],  # type: ignore[return-value]
                                          self.format) for i, n in enumerate(("k", "v")))


@dataclass
class Int4WritePlan:
    """Where one step's tokens go in an int4 cache (one cache group). Tokens of blocks that stay
    open go straight to their residual slots; blocks that fill this step are assembled in a
    staging tensor (their earlier tokens from their slot) and quantized from it."""

    open_tokens: torch.Tensor  # [n] indices into the step's tokens
    open_rows: torch.Tensor  # [n] their rows in the flat residual (slot * bs + offset)
    done_tokens: torch.Tensor  # [m] tokens of blocks that fill this step
    done_rows: torch.Tensor  # [m] their rows in the staging tensor (index * bs + offset)
    done_blocks: torch.Tensor  # [d] the blocks that fill, in staging order
    done_from: list[tuple[int, int]]  # (staging index, slot): earlier tokens waiting in a slot
    reopened: list[tuple[int, int]]  # (block, slot): a full block written again, its tokens dequantized


class Int4KVStorage(BlockTensorStorage):
    """KIVI's int4: keys per channel over each block, values per token. A block is quantized once,
    when its last slot is written; until then its tokens wait in full precision in a residual
    slot (`residual[j]["k"/"v"]` [slots, bs, kvh, hd], the model's dtype) named by
    `slot_of[block]` (-1: none; a tensor, for the kernel). Reads of an open block come from its slot.

    A block's slot outlives its filling by a step, so a rollback right after (rejected proposals
    that had filled the block) reopens it from the exact tokens; a block reopened later comes
    back from its quantized values."""

    kind = "int4"

    def __init__(self, layer_to_tensor: Sequence[int], num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, device: torch.device | str, residual_dtype: torch.dtype,
                 num_residual_slots: int) -> None:
        packed, per_token, per_channel = (block_size, num_kv_heads, head_dim // 2), (block_size, num_kv_heads), \
            (num_kv_heads, head_dim)
        super().__init__(layer_to_tensor, num_blocks, block_size, {
            "k": (packed, torch.uint8), "k_scale": (per_channel, torch.float16), "k_zero": (per_channel, torch.float16),
            "v": (packed, torch.uint8), "v_scale": (per_token, torch.float16), "v_zero": (per_token, torch.float16)},
            device)
        self.row_shape = (block_size, num_kv_heads, head_dim)
        self.residual_dtype = residual_dtype
        self.residual: list[dict[str, torch.Tensor]] = []
        self.slot_of = torch.full((num_blocks,), -1, dtype=torch.long, device=self.device)
        self._slots: dict[int, int] = {}  # open block -> its slot (slot_of as a dict)
        self._free_slots: list[int] = []
        self._filled: dict[int, int] = {}  # block -> slot, filled this step
        self._filled_before: dict[int, int] = {}  # likewise, the step before: freed at the next step
        self._step_slots: dict[int, int] = {}  # block -> slot holding its tokens from before this step
        self._grow(max(num_residual_slots, 1))

    @property
    def num_residual_slots(self) -> int:
        return self.residual[0]["k"].shape[0]

    @property
    def residual_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for r in self.residual for t in r.values())

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.residual_nbytes

    def populate(self) -> None:
        super().populate()
        if self.device.type == "cpu":
            for r in self.residual:
                for t in r.values():
                    t.zero_()

    # ---- writes ----
    def begin_step(self) -> None:
        self._free_slots += self._filled_before.values()
        self._filled_before, self._filled = self._filled, {}
        self._step_slots = {}

    def plan_writes(self, slot_mapping: torch.Tensor) -> Int4WritePlan:
        bs = self.block_size
        blocks, offsets = (slot_mapping // bs).tolist(), (slot_mapping % bs).tolist()
        filling = {b for b, o in zip(blocks, offsets) if o == bs - 1}
        staging: dict[int, int] = {}
        seen: set[int] = set()
        reopened: list[tuple[int, int]] = []
        plan: dict[str, list[int]] = {"open_tokens": [], "open_rows": [], "done_tokens": [], "done_rows": []}
        for i, (block, offset) in enumerate(zip(blocks, offsets)):
            if block not in seen:
                seen.add(block)
                self._first_write(block, offset, reopened)
            if block in filling:
                staging.setdefault(block, len(staging))
                plan["done_tokens"].append(i)
                plan["done_rows"].append(staging[block] * bs + offset)
            else:
                slot = self._slots.get(block)
                if slot is None:
                    slot = self._take_slot(block)
                plan["open_tokens"].append(i)
                plan["open_rows"].append(slot * bs + offset)
        done_from = [(u, self._slots[b]) for b, u in staging.items() if b in self._slots]
        for block in staging:  # quantized in this step's writes, which still read the slot
            slot = self._slots.pop(block, None)
            if slot is not None:
                self.slot_of[block] = -1
                self._filled[block] = slot
        t = {k: torch.tensor(v, dtype=torch.long, device=self.device) for k, v in plan.items()}
        return Int4WritePlan(t["open_tokens"], t["open_rows"], t["done_tokens"], t["done_rows"],
                             torch.tensor(list(staging), dtype=torch.long, device=self.device), done_from, reopened)

    def _first_write(self, block: int, offset: int, reopened: list[tuple[int, int]]) -> None:
        """The step's first write into a block: note the slot holding its earlier tokens, and
        reopen a full block written again (exactly from a slot it filled from a step ago, or
        from its quantized values)."""
        if block not in self._slots and offset:
            recent = self._filled.pop(block, None)
            if recent is None:
                recent = self._filled_before.pop(block, None)
            if recent is not None:
                self._slots[block] = recent
                self.slot_of[block] = recent
            else:
                reopened.append((block, self._take_slot(block)))
        if block in self._slots:
            self._step_slots[block] = self._slots[block]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: Any) -> None:
        assert isinstance(plan, Int4WritePlan)
        t, r = self.layer_tensors(layer), self.residual[self.layer_to_tensor[layer]]
        for block, slot in plan.reopened:
            k_old, v_old = self._dequantize(t, torch.tensor([block], device=self.device))
            r["k"][slot], r["v"][slot] = k_old[0], v_old[0]
        stage = {name: torch.empty(len(plan.done_blocks), *self.row_shape, dtype=self.residual_dtype,
                                   device=self.device) for name in ("k", "v")}
        for index, slot in plan.done_from:
            stage["k"][index], stage["v"][index] = r["k"][slot], r["v"][slot]
        for name, x in (("k", k), ("v", v)):
            x = x.to(self.residual_dtype)
            r[name].view(-1, *x.shape[1:]).index_put_((plan.open_rows,), x[plan.open_tokens])
            stage[name].view(-1, *x.shape[1:]).index_put_((plan.done_rows,), x[plan.done_tokens])
        if len(plan.done_blocks):
            blocks = plan.done_blocks
            t["k"][blocks], t["k_scale"][blocks], t["k_zero"][blocks] = quant.quantize_int4(stage["k"], dim=-3)
            t["v"][blocks], t["v_scale"][blocks], t["v_zero"][blocks] = quant.quantize_int4(stage["v"], dim=-1)

    # ---- reads ----
    def decode_operands(self, layer: int) -> tuple[Any, ...]:
        t, r = self.layer_tensors(layer), self.residual[self.layer_to_tensor[layer]]
        return t["k"], t["k_scale"], t["k_zero"], t["v"], t["v_scale"], t["v_zero"], self.slot_of, r["k"], r["v"]

    def gather(self, layer: int, block_tables: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, r = self.layer_tensors(layer), self.residual[self.layer_to_tensor[layer]]
        flat = block_tables.reshape(-1)
        k, v = self._dequantize(t, flat)  # [n, bs, kvh, hd] fp32
        slots = self.slot_of[flat]
        is_open = slots >= 0
        if bool(is_open.any()):
            k[is_open], v[is_open] = r["k"][slots[is_open]].float(), r["v"][slots[is_open]].float()
        shape = (*block_tables.shape[:-1], -1, *self.row_shape[1:])
        return k[:, :num_slots].reshape(shape), v[:, :num_slots].reshape(shape)

    def chunk_view(self, start: int, q_len: int, device: torch.device) -> ChunkView:
        """A query sees the cache right after its own write: blocks filled by then quantized, and
        its own block, unless it just filled it, as written. The keys are the cache's context
        followed by the exact tail from the first query's block start ([S0 + tail]):

            query p in block b, p not b's last slot: cache keys before b, tail keys b_start..p
            query p that fills its block:            cache keys 0..p"""
        bs, context_len = self.block_size, start + q_len
        tail_start = start - start % bs
        p = torch.arange(start, context_len, device=device).unsqueeze(1)
        own_block = p - p % bs
        fills = (p % bs) == bs - 1
        cache_pos = torch.arange(context_len, device=device).unsqueeze(0)
        tail_pos = torch.arange(tail_start, context_len, device=device).unsqueeze(0)
        cache_mask = torch.where(fills, cache_pos <= p, cache_pos < own_block)
        tail_mask = ~fills & (tail_pos >= own_block) & (tail_pos <= p)
        return ChunkView(torch.cat([cache_mask, tail_mask], dim=1), key_positions=torch.cat([cache_pos, tail_pos], 1)[0])

    def chunk_context(self, layer: int, block_table: torch.Tensor, start: int, k: torch.Tensor,
                      v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().chunk_context(layer, block_table, start, k, v)
        before = start % self.block_size  # tokens of the first query's block written in earlier steps
        if before:
            slot = self._step_slots[int(block_table[start // self.block_size])]
            r = self.residual[self.layer_to_tensor[layer]]
            k, v = torch.cat([r["k"][slot, :before].to(k.dtype), k]), torch.cat([r["v"][slot, :before].to(v.dtype), v])
        return torch.cat([keys, k.to(keys.dtype)]), torch.cat([values, v.to(values.dtype)])

    def _dequantize(self, t: dict[str, torch.Tensor], blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = quant.dequantize_int4(t["k"][blocks], t["k_scale"][blocks], t["k_zero"][blocks], dim=-3)
        v = quant.dequantize_int4(t["v"][blocks], t["v_scale"][blocks], t["v_zero"][blocks], dim=-1)
        return k, v

    # ---- block state ----
    def release(self, block_ids: Sequence[int]) -> None:
        for block in block_ids:
            slot = self._slots.pop(block, None)
            if slot is not None:
                self.slot_of[block] = -1
                self._free_slots.append(slot)
            for filled in (self._filled, self._filled_before):  # no longer a rollback to serve
                slot = filled.pop(block, None)
                if slot is not None:
                    self._free_slots.append(slot)

    def copy_blocks(self, pairs: BlockPairs) -> None:
        super().copy_blocks(pairs)
        for src, dst in pairs:
            self._copy_residual(self, src, dst)

    def swap_out(self, dst: KVStorage, pairs: BlockPairs) -> None:
        super().swap_out(dst, pairs)
        assert isinstance(dst, Int4KVStorage)
        for src, d in pairs:
            self._copy_residual(dst, src, d)

    def _copy_residual(self, dst: "Int4KVStorage", src: int, block: int) -> None:
        """block (in dst) gets src's open-block state: a residual slot holding the same tokens."""
        dst.release([block])
        slot = self._slots.get(src)
        if slot is None:
            return
        new = dst._take_slot(block)
        for mine, theirs in zip(self.residual, dst.residual):
            for name in ("k", "v"):
                theirs[name][new] = mine[name][slot].to(dst.device)

    def _take_slot(self, block: int) -> int:
        if not self._free_slots:
            self._grow(2 * self.num_residual_slots)
        slot = self._free_slots.pop()
        self._slots[block] = slot
        self.slot_of[block] = slot
        return slot

    def _grow(self, num_slots: int) -> None:
        """More residual slots: more sequences hold an open block than were planned for."""
        old = self.num_residual_slots if self.residual else 0
        fresh = [{name: zeros((num_slots, *self.row_shape), self.residual_dtype, self.device) for name in ("k", "v")}
                 for _ in self.tensors]
        for i, r in enumerate(self.residual):
            for name in ("k", "v"):
                fresh[i][name][:old] = r[name]
        self.residual = fresh
        self._free_slots += list(range(num_slots - 1, old - 1, -1))


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On CPU a private anonymous mapping of its own, whose pages the OS hands
    out already zero when first touched: a 4 GiB cache is ready at once instead of after 5 s of
    writing zeros, and blocks never written (the null block among them) cost no memory (in huge
    pages where the OS has them: `huge_pages`). Zeros, not garbage: a padded or masked-out slot
    is still multiplied by 0 and must not be NaN."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # A private anonymous mapping of its own, not calloc: a heap that malloc reuses (when it
    # cannot map) would be cleared by writing, making every page resident at once.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
    huge_pages(pages)
    return torch.from_numpy(np.frombuffer(pages, dtype=np.uint8)).view(dtype).view(shape)


def huge_pages(pages: mmap.mmap) -> None:
    """Advise the mapping into transparent huge pages (2 MiB), which Linux then gives where its
    THP mode is "always" or "madvise" (Debian's and Ubuntu's default) and not where it is
    "never": a cache's blocks lie anywhere in it, and with 4 KiB pages each block read missed
    the TLB (a page walk) and each first write took a page fault. One layer of decode attention
    over 64 contexts of 256 tokens read from memory took 1.18-1.31 ms against 1.57-1.63 (bf16;
    int8 0.83-0.86 against 1.04-1.07), and 64 rows written into fresh blocks 21 us against 298.
    Memory still comes on first write, 2 MiB at a time (and where the OS compacts memory to find
    one, that write waits for it). A system without the advice keeps 4 KiB pages."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        pages.madvise(advice)
    except OSError:
        pass  # an advice the kernel does not take: the mapping works as it is


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_slots: int) -> torch.Tensor:
    """index_select over whole blocks copies contiguous chunks (about twice as fast as advanced
    indexing on CPU); narrowing first keeps a contiguous-layout slab from being copied whole."""
    src = cache if num_slots == cache.shape[1] else cache[:, :num_slots]
    blocks = src.index_select(0, block_tables.reshape(-1))  # [B * nb, s, ...]
    return blocks.view(*block_tables.shape[:-1], -1, *cache.shape[2:])


def _index(pairs: BlockPairs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
    return src, dst


def make_storage(kind: str, name: str, layer_to_tensor: Sequence[int], num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, model_dtype: torch.dtype, device: torch.device | str,
                 num_residual_slots: int = 0) -> KVStorage:
    """The storage of a format (kvserve.kv.formats): kind "dense" keeps dtype `name`."""
    args = (layer_to_tensor, num_blocks, block_size, num_kv_heads, head_dim)
    if kind == "dense":
        return DenseKVStorage(*args, getattr(torch, name), device)
    if kind == "int8":
        return Int8KVStorage(*args, device)
    if kind == "fp8":
        return Fp8KVStorage(*args, device, name)
    if kind == "int4":
        return Int4KVStorage(*args, device, model_dtype, num_residual_slots)
    raise ValueError(f"no storage for kv cache format {name!r}")
