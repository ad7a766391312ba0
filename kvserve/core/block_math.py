"""Block arithmetic in one place. Nowhere else divides by `block_size`.

A sequence's tokens fill its blocks in order; with block_size 4:

    positions  0 1 2 3 | 4 5 6 7 | 8 9
    logical    block 0 | block 1 | block 2 (2 of 4 slots used)
    physical   table[0]| table[1]| table[2]

slot = physical_block_id * block_size + offset is the row of the flat cache tensor.
"""

from __future__ import annotations

from typing import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division: cdiv(10, 4) == 3."""
    return -(-a // b)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens: num_blocks_for(10, 4) == 3, num_blocks_for(8, 4) == 2."""
    return cdiv(num_tokens, block_size)


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks completely filled by num_tokens: num_full_blocks(10, 4) == 2."""
    return num_tokens // block_size


def block_index(position: int, block_size: int) -> int:
    """Logical block holding a position: block_index(9, 4) == 2."""
    return position // block_size


def block_offset(position: int, block_size: int) -> int:
    """Offset of a position inside its block: block_offset(9, 4) == 1."""
    return position % block_size


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """Flat cache row of a position: slot_of([7, 3, 5], 9, 4) == 5 * 4 + 1 == 21."""
    return block_table[position // block_size] * block_size + position % block_size


def slots_for(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions [start, end): slots_for([7, 3], 3, 6, 4) == [31, 12, 13]."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def padded_slots(num_tokens: int, block_size: int) -> int:
    """Slots reserved for num_tokens in whole blocks: padded_slots(10, 4) == 12."""
    return num_blocks_for(num_tokens, block_size) * block_size


def blocks_in_budget(budget_bytes: int, block_bytes: int) -> int:
    """Whole blocks that fit in a byte budget: blocks_in_budget(1 << 20, 4096) == 256."""
    return budget_bytes // block_bytes if block_bytes > 0 else 0
