"""The runner's copy of every request's block table in one cache group, kept between steps.

The scheduler sends only what changed in a table (new blocks, a copied last block, a rollback);
each request owns a row of one int64 tensor, so a step's slot mapping and the decodes' tables
are tensor gathers whatever the context length; a list per request mirrors its row, so a
decode step's few slots are Python arithmetic (`slot`) instead of tensor ops:

    rows     request a -> 0, request b -> 1
    table    [[ 7  3  9 12  N  N ...]      N: the null block (unused entries)
              [ 4 11  N  N  N  N ...]]
    slot(position p of row r) = table[r, p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvserve.core.block_math import cdiv, slot_of


class BlockTables:
    def __init__(self, null_block_id: int, block_size: int, max_blocks_per_seq: int,
                 device: torch.device, num_rows: int = 64) -> None:
        self.null_block_id, self.block_size, self.device = null_block_id, block_size, device
        self.table = torch.full((num_rows, max_blocks_per_seq), null_block_id, dtype=torch.long)
        self.rows: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}  # each request's row as a list (entries past its end stale)
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def update(self, request_id: str, start: int, block_ids: Sequence[int]) -> None:
        """Entries [start, start + len(block_ids)) of the request's table become block_ids."""
        row = self.rows.get(request_id)
        if row is None:
            row = self.rows[request_id] = self._take_row()
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(cols=max(end, 2 * self.table.shape[1]))
        if block_ids:
            self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.long)
        mirror = self.block_ids.setdefault(request_id, [])
        if len(mirror) < start:
            mirror += [self.null_block_id] * (start - len(mirror))
        mirror[start:end] = block_ids

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            self.block_ids.pop(rid, None)
            if row is not None:
                self._free_rows.append(row)

    def row_index(self, request_ids: Sequence[str]) -> torch.Tensor:
        """[B] rows of these requests."""
        return torch.tensor([self.rows[r] for r in request_ids], dtype=torch.long)

    def tables(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[B, cdiv(num_tokens, block_size)] the first entries of these rows, on the device."""
        return self.table[rows, :cdiv(num_tokens, self.block_size)].to(self.device)

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] slots of positions [T] of the rows [T] (one row per token), on the device."""
        blocks = self.table[rows, positions // self.block_size]
        return (blocks * self.block_size + positions % self.block_size).to(self.device)

    def slot(self, request_id: str, position: int) -> int:
        """The slot of one position of a request, from its list (no tensor op)."""
        return slot_of(self.block_ids[request_id], position, self.block_size)

    def _take_row(self) -> int:
        if not self._free_rows:
            n = self.table.shape[0]
            self._grow(rows=2 * n)
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        old = self.table
        self.table = torch.full((max(rows, old.shape[0]), max(cols, old.shape[1])), self.null_block_id,
                                dtype=torch.long)
        self.table[:old.shape[0], :old.shape[1]] = old
