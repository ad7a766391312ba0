from kvserve.core import block_math as bm


def test_docstring_examples_hold():
    assert bm.cdiv(10, 4) == 3 and bm.cdiv(8, 4) == 2 and bm.cdiv(0, 4) == 0
    assert bm.num_blocks_for(10, 4) == 3 and bm.num_full_blocks(10, 4) == 2
    assert bm.block_index(9, 4) == 2 and bm.block_offset(9, 4) == 1
    assert bm.slot_of([7, 3, 5], 9, 4) == 21
    assert bm.slots_for([7, 3], 3, 6, 4) == [31, 12, 13]
    assert bm.padded_slots(10, 4) == 12
    assert bm.blocks_in_budget(1 << 20, 4096) == 256


def test_slots_are_unique_across_block_tables():
    tables = {"a": [0, 5, 2], "b": [1, 3, 4]}
    slots = [s for t in tables.values() for s in bm.slots_for(t, 0, 12, 4)]
    assert len(slots) == len(set(slots)) == 24
