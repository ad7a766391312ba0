"""What one engine hands another when a prompt's K/V moves (disaggregated prefill): the
request's state after its first token, its blocks in the cache's own format (values and any
scales, whole blocks in table order), and the identity of what computed them.

    prefill engine                                   decode engine
    blocks [7, 2, 9] --read (swap_out)--> [0, 1, 2] ==connector==> [0, 1, 2] --load--> blocks [4, 5, 1]

A handover is loaded only where the identity matches (model, KV format, layers, unsharded KV
heads, head size, block size): anything else would be read as the wrong numbers.

The handover is the engine's own data (it states its identity, `LLMEngine.add_prefilled` loads
one); what carries it between engines lives on the floor above (kvserve.distributed.disagg).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from kvserve.kv.storage import BlockTensorStorage, make_storage


@dataclass(frozen=True)
class KVIdentity:
    model_id: str
    kv_cache_dtype: str
    num_layers: int
    num_kv_heads: int  # of the whole model, whatever the ranks hold
    head_dim: int
    block_size: int

    def check(self, other: "KVIdentity") -> None:
        """Raise ValueError naming each field where other (a handover's) differs from this engine."""
        diff = [f"{f.name} {getattr(other, f.name)!r} (this engine: {getattr(self, f.name)!r})"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if diff:
            raise ValueError("the handed-over K/V cannot be loaded here: " + "; ".join(diff))


@dataclass
class KVHandover:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the first token, sampled by the prefill engine
    output_logprobs: list[dict[int, float]]
    identity: KVIdentity
    num_tokens: int  # tokens whose K/V the blocks hold (the prompt); 0: the first token ended the request
    kind: str  # the storage kind ("dense", "int8", "fp8")
    layer_to_tensor: tuple[int, ...]
    blocks: list[dict[str, torch.Tensor]]  # per layer-tensor set, name -> [num_blocks, ...] on the CPU
    sampling_key: Optional[int] = None  # the key of the request's random numbers (Sampler.key)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in self.blocks for t in part.values())

    def source(self, dtype: str) -> BlockTensorStorage:
        """The blocks as a storage the receiving cache swaps in from."""
        num_blocks = next(iter(self.blocks[0].values())).shape[0]
        i = self.identity
        storage = make_storage(self.kind, i.kv_cache_dtype, self.layer_to_tensor, num_blocks, i.block_size,
                               i.num_kv_heads, i.head_dim, getattr(torch, dtype), "cpu", 0)
        assert isinstance(storage, BlockTensorStorage)
        storage.tensors = self.blocks
        return storage


def read_blocks(storage: BlockTensorStorage, block_ids: list[int]) -> list[dict[str, torch.Tensor]]:
    """Copies of these blocks (every layer's tensors, blocks in the order given) on the CPU, in
    the storage's own format."""
    index = torch.tensor(block_ids, dtype=torch.long, device=storage.device)
    return [{name: t[index].cpu() for name, t in part.items()} for part in storage.tensors]
