"""The runner's block tables: updated by the scheduler's deltas, rows reused, grown on demand,
and read as tensors (slots, padded tables) without walking any context."""

import torch

from kvserve.runner.block_table import BlockTables

NULL = 99


def test_deltas_rows_and_slots():
    t = BlockTables(NULL, 4, max_blocks_per_seq=3, device=torch.device("cpu"), num_rows=1)
    t.update("a", 0, [7, 3])
    t.update("b", 0, [5])  # a second row: the table grows
    t.update("a", 1, [8, 2, 6])  # copy-on-write replaced entry 1, two more appended: columns grow
    assert t.table.shape[0] >= 2 and t.table.shape[1] >= 4
    rows = t.row_index(["a", "b"])
    assert t.tables(rows, 13).tolist() == [[7, 8, 2, 6], [5, NULL, NULL, NULL]]  # padded with the null block
    slots = t.slots(torch.tensor([rows[0], rows[0], rows[1]]), torch.tensor([3, 9, 2]))
    assert slots.tolist() == [7 * 4 + 3, 2 * 4 + 1, 5 * 4 + 2]
    t.forget(["a"])
    t.update("c", 0, [1])  # takes a's row back
    assert t.rows["c"] == rows[0].item() and t.tables(t.row_index(["c"]), 4).tolist() == [[1]]
    t.update("c", 1, [])  # a rollback that only shortened the table: nothing to write
    assert t.tables(t.row_index(["c"]), 4).tolist() == [[1]]


def test_slot_from_the_list_equals_the_tensor_gather():
    """Each request's list mirrors its row through appends, a copy-on-write replacement, a
    rollback, a gap (an entry set past the end) and a row taken back after a forget."""
    t = BlockTables(NULL, 4, max_blocks_per_seq=2, device=torch.device("cpu"), num_rows=1)
    t.update("a", 0, [7, 3])
    t.update("b", 0, [5, 1, 9])
    t.update("a", 1, [8, 2, 6])
    t.update("b", 1, [])  # a rollback: nothing written, the entries past the end are stale
    t.forget(["b"])
    t.update("c", 0, [4])  # b's row, whose tensor entries 1 and 2 still hold 1 and 9
    t.update("c", 2, [11])  # entry 1 left as it was
    for rid, positions in (("a", range(16)), ("c", [0, 3, 8, 11])):
        rows = torch.full((len(positions),), t.rows[rid], dtype=torch.long)
        expected = t.slots(rows, torch.tensor(list(positions))).tolist()
        assert [t.slot(rid, p) for p in positions] == expected
    assert t.slot("a", 13) == 6 * 4 + 1 and "b" not in t.block_ids
