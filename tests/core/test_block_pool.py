import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.core.block_hash import hash_block, root_hash
from kvserve.core.block_pool import BlockPool

ROOT = root_hash("model", "float32")


def test_take_release_and_lru_eviction_order():
    pool = BlockPool(4)
    a = pool.take(2)
    assert a == [0, 1]
    h0, h1 = hash_block(ROOT, [1, 2]), hash_block(ROOT, [3, 4])
    pool.cache(0, h0, ROOT, (1, 2))
    pool.cache(1, h1, ROOT, (3, 4))
    pool.release([1, 0])  # tail first: block 1 is evicted before block 0
    pool.check_integrity({})
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    # uncached blocks 2, 3 go first, then the least recently freed cached block (1)
    assert pool.take(3) == [2, 3, 1]
    assert pool.lookup(h1, ROOT, (3, 4)) is None and pool.lookup(h0, ROOT, (1, 2)) == 0
    assert pool.num_evictions == 1


def test_hit_revives_block_from_middle_of_queue():
    pool = BlockPool(3)
    ids = pool.take(3)
    for i in ids:
        pool.cache(i, hash_block(ROOT, [i]), ROOT, (i,))
    pool.release(ids)
    pool.ref([1])
    pool.check_integrity({1: 1})
    assert pool.take(2) == [0, 2]


def test_lookup_compares_tokens_and_parent():
    pool = BlockPool(2)
    (b,) = pool.take(1)
    h = hash_block(ROOT, [1, 2])
    pool.cache(b, h, ROOT, (1, 2))
    assert pool.lookup(h, ROOT, (1, 2)) == b
    assert pool.lookup(h, ROOT, (9, 9)) is None  # a forged collision never hits
    assert pool.lookup(h, root_hash("other"), (1, 2)) is None


def test_errors_are_clear():
    pool = BlockPool(1)
    with pytest.raises(RuntimeError, match="asked for 2 blocks"):
        pool.take(2)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([0])
    with pytest.raises(ValueError):
        BlockPool(0)


class PoolMachine(RuleBasedStateMachine):
    """Random take / ref / release / cache / lookup never break the pool's invariants."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(8)
        self.tables: list[list[int]] = []  # each "sequence" owns references
        self.contents: dict[int, tuple[int, ...]] = {}  # block -> tokens it holds

    @precondition(lambda self: self.pool.num_free_blocks > 0)
    @rule(n=st.integers(1, 3), tok=st.integers(0, 5))
    def take(self, n, tok):
        n = min(n, self.pool.num_free_blocks)
        ids = self.pool.take(n)
        for i in ids:
            self.contents[i] = (tok, i)
        self.tables.append(ids)

    @precondition(lambda self: self.tables)
    @rule(k=st.integers(0, 100))
    def cache_first(self, k):
        table = self.tables[k % len(self.tables)]
        b = table[0]
        toks = self.contents[b]
        self.pool.cache(b, hash_block(ROOT, toks), ROOT, toks)

    @precondition(lambda self: self.tables)
    @rule(k=st.integers(0, 100))
    def share(self, k):
        table = self.tables[k % len(self.tables)]
        self.pool.ref(table)
        self.tables.append(list(table))

    @precondition(lambda self: self.tables)
    @rule(k=st.integers(0, 100))
    def release(self, k):
        table = self.tables.pop(k % len(self.tables))
        self.pool.release(reversed(table))

    @rule(tok=st.integers(0, 5), b=st.integers(0, 7))
    def lookup(self, tok, b):
        toks = (tok, b)
        hit = self.pool.lookup(hash_block(ROOT, toks), ROOT, toks)
        if hit is not None:  # a hit always holds exactly the tokens asked for
            assert self.pool.blocks[hit].token_ids == toks

    @invariant()
    def integrity(self):
        refs: dict[int, int] = {}
        for t in self.tables:
            for b in t:
                refs[b] = refs.get(b, 0) + 1
        self.pool.check_integrity(refs)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
