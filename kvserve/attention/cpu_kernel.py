"""The CPU kernel backend: decodes through the compiled kernel
(kvserve/kernels/csrc/paged_attention.cpp), which reads each context's K/V blocks in place
through the block table, exactly its length (no gathered copy, no padding mask), dequantizing
quantized blocks (int8, fp8, int4) one block at a time in registers; an MLA latent cache
(dense, int8 or fp8 rows) decodes through mla_attention.cpp in the absorbed form, reading each
token's [latent | rotary key] row in place. A prompt's chunk whose mask is plain causal attends
through chunk_attention.cpp in fp32 (over its keys as the cache gives them back), except where
the CPU multiplies bf16 in AMX tiles (chunk_kernel); other chunks take the torch path."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from kvserve import kernels
from kvserve.attention.backend import AttentionMetadata, LayerDecode
from kvserve.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from kvserve.kv.storage import ChunkView, KVStorage


def kernel_name(storage: Optional[KVStorage] = None) -> str:
    """The compiled kernel that decodes over this storage's blocks (paged_attention without one)."""
    entry = DECODE_ENTRIES.get(storage.kind) if storage is not None else None
    return entry[0] if entry is not None else "paged_attention"


def kernel_module(isa: Optional[str] = None, storage: Optional[KVStorage] = None) -> Optional[Any]:
    """The kernel for `storage` at level `isa` (default: the best this CPU runs), or None where
    it cannot be built or compiled kernels are turned off."""
    return kernels.load(kernel_name(storage), isa)


def failure(storage: Optional[KVStorage] = None) -> Optional[str]:
    return kernels.failure(kernel_name(storage))


# the compiled kernel and its entry point for each storage kind (kvserve.kv.storage,
# kvserve.kv.latent); each entry takes q, the storage's decode_operands, block tables, context
# lengths, scale and window. MLA's latent rows are read by mla_attention.cpp in the absorbed form.
DECODE_ENTRIES = {"dense": ("paged_attention", "paged_decode"), "int8": ("paged_attention", "paged_decode_int8"),
                  "fp8": ("paged_attention", "paged_decode_fp8"), "int4": ("paged_attention", "paged_decode_int4"),
                  "latent": ("mla_attention", "mla_decode"), "latent_int8": ("mla_attention", "mla_decode_int8"),
                  "latent_fp8": ("mla_attention", "mla_decode_fp8")}


def decode_kernel(module: Any, storage: KVStorage) -> Callable[..., torch.Tensor]:
    """The kernel function that decodes over this storage's blocks in place (module: the
    build of kernel_name(storage))."""
    entry = DECODE_ENTRIES.get(storage.kind)
    if entry is None:
        raise ValueError(f"the CPU attention kernel reads no {storage.kind!r} storage; it reads "
                         f"{sorted(DECODE_ENTRIES)}")
    if not hasattr(module, entry[1]):
        raise ValueError(f"{storage.kind!r} blocks are decoded by the {entry[0]} kernel, not by {module.__name__}")
    return getattr(module, entry[1])  # type: ignore[no-any-return]


def chunk_kernel(cpu_flags: frozenset[str]) -> Optional[Any]:
    """The compiled kernel a prompt's causal chunk attends through on a CPU with these flags
    (chunk_attention.cpp, fp32 over the keys as the cache gives them back), or None: PyTorch's
    SDPA (kvserve.attention.torch_backend.chunk_dtype). On AMD EPYC Zen 4 (AVX-512, 2 threads)
    the kernel takes 213 us for one SmolLM2 layer of 132 tokens over bf16 keys, where SDPA takes
    514 in bf16 and 470 in fp32 (512 tokens: 2.3 ms against 4.8 and 4.4; docs/defaults.md).
    Where the CPU has AMX bf16 tiles, SDPA's bf16 attention runs on them (120 us at 128 tokens on
    the Xeon) and keeps the chunks: the kernel was not measured there."""
    return None if "amx_bf16" in cpu_flags else kernels.load("chunk_attention")


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu-kernel"

    def __init__(self, block_size: int, dtype: torch.dtype, module: Any,
                 chunks: Optional[Any] = None) -> None:
        super().__init__(block_size, dtype)
        self.module = module
        self.chunks = chunks  # chunk_attention's build (None: chunks through SDPA)
        self.chunk_head_dims = frozenset(chunks.head_dims()) if chunks is not None else frozenset()

    @staticmethod
    def supports(storage: Optional[KVStorage], device: torch.device, dtype: torch.dtype) -> bool:
        """A paged cache on CPU, in any format it has an entry for (it reads each format's blocks
        itself, MLA's latent rows too)."""
        return device.type == "cpu" and storage is not None and storage.kind in DECODE_ENTRIES

    def _decode_mask(self, meta: TorchAttentionMetadata) -> None:
        """The kernel reads each context's exact length: no padding mask to build (groups with
        attention sinks decode through the torch path: the kernel scores every key from one query)."""
        if meta.sinks:
            super()._decode_mask(meta)

    def decode(self, layer: int, q: torch.Tensor, storage: KVStorage, meta: AttentionMetadata,
               scale: float, softcap: Optional[float] = None, q_sink: Optional[torch.Tensor] = None) -> torch.Tensor:
        if meta.sinks:
            return super().decode(layer, q, storage, meta, scale, softcap, q_sink)
        assert softcap is None, "the kernel does not soft-cap scores: such models take the torch backend"
        return decode_kernel(self.module, storage)(q.contiguous(), *storage.decode_operands(layer),
                                                   meta.decode_block_tables, meta.decode_context_lens, scale,
                                                   meta.sliding_window or 0)

    def _attend_chunk(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      view: Optional[ChunkView], scale: float, softcap: Optional[float],
                      q_sink: Optional[torch.Tensor]) -> torch.Tensor:
        """A chunk whose mask is plain causal (no view: its own keys; or the view says so), with
        nothing written out (soft caps, sinks), fp32 queries on CPU and keys as wide as values,
        through the chunk kernel (keys neither fp32 nor bf16 made fp32 first); any other through
        SDPA."""
        columns = q.shape[0] if view is None else view.mask.shape[1]  # the keys the mask is for
        if (self.chunks is None or softcap is not None or q_sink is not None or q.dtype != torch.float32
                or not (view is None or view.causal) or keys.shape != values.shape
                or keys.shape[0] != columns or q.shape[-1] != keys.shape[-1]
                or q.shape[-1] not in self.chunk_head_dims or q.device.type != "cpu"):
            return super()._attend_chunk(q, keys, values, view, scale, softcap, q_sink)
        if keys.dtype not in (torch.float32, torch.bfloat16):
            keys, values = keys.float(), values.float()
        return self.chunks.chunk_attention(q, keys, values, scale)  # type: ignore[no-any-return]

    def build_metadata(self, common: AttentionMetadata, storage: Optional[KVStorage]) -> TorchAttentionMetadata:
        meta = super().build_metadata(common, storage)
        meta.plain_decode = (storage is not None and meta.slot_mapping is not None and not meta.prefills
                             and meta.num_decode_tokens > 0 and not meta.sinks and meta.sink_rotation is None)
        return meta

    def layer_decode(self, layer: int, scale: float, softcap: Optional[float],
                     storage: Optional[KVStorage]) -> Optional[LayerDecode]:
        """fixed_forward's write and kernel below (a storage whose tensors stay put, dense or int8)."""
        if storage is None or softcap is not None or storage.kind not in ("dense", "int8"):
            return None
        fixed, store = storage.fixed_decode(layer), storage.fixed_store(layer)
        if fixed is None or store is None or not hasattr(self.module, "decode_op"):
            return None
        return LayerDecode(self.module.decode_op(storage.kind, list(fixed[1]), scale), *store)

    def fast_forward(self, layer: int, group: int, scale: float, softcap: Optional[float],
                     storage: Optional[KVStorage]) -> Optional[Callable[..., torch.Tensor]]:
        """A step whose rows are all plain decodes (no chunk, no sinks) writes its K/V and calls
        the kernel for this storage (looked up once here) on the layer's operands: settled once
        where the storage's tensors stay put (KVStorage.fixed_decode), else asked for at each
        call; what `forward` does for such a step, on the same arguments. Any other step takes
        `forward`. (The kernel reads q through a contiguous copy where it is not contiguous.)"""
        if storage is None or softcap is not None:
            return None
        kernel, eager = decode_kernel(self.module, storage), self.forward
        fixed = storage.fixed_decode(layer)
        if fixed is None:
            operands, write = storage.decode_operands, storage.write

            def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Any) -> torch.Tensor:
                meta = ctx.metadata[group]
                if not meta.plain_decode:
                    return eager(layer, q, k, v, ctx.storage, meta, scale, softcap)
                write(layer, k, v, meta.kv_write_plan)  # what write_kv does where a step has slots
                return kernel(q.contiguous(), *operands(layer), meta.decode_block_tables,
                              meta.decode_context_lens, scale, meta.sliding_window or 0)
            return forward
        store, fixed_operands = fixed

        def fixed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Any) -> torch.Tensor:
            meta = ctx.metadata[group]
            if not meta.plain_decode:
                return eager(layer, q, k, v, ctx.storage, meta, scale, softcap)
            store(meta.kv_write_plan, k, v)
            return kernel(q, *fixed_operands, meta.decode_block_tables, meta.decode_context_lens, scale,
                          meta.sliding_window or 0)
        return fixed_forward
