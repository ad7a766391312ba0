"""Chain hashes that name a full block by everything that shaped its K/V.

    root = H(model id, dtype, kv dtype, adapter, cache_salt)
    h0   = H(root, tokens[0:B])
    h1   = H(h0,   tokens[B:2B])   ...

A block's hash therefore covers its own tokens and, through its parent, every token before it
and the key of the model that computed it; two tenants with different salts never share a block.
SHA-256 makes accidental collisions practically impossible; lookups still compare token ids.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

BlockHash = bytes


def root_hash(*keys: object) -> BlockHash:
    """The parent of a sequence's first block: hashes the cache namespace keys (None skipped)."""
    text = "\x1f".join("" if k is None else repr(k) for k in keys)
    return hashlib.sha256(b"kvserve-root\x00" + text.encode()).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    packed = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(parent + packed).digest()


def hash_full_blocks(parent: Optional[BlockHash], token_ids: Sequence[int], block_size: int,
                     start_block: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks from start_block on; `parent` is the hash before start_block."""
    assert parent is not None
    hashes = []
    for i in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
