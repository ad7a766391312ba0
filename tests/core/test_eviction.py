"""Each eviction policy takes exactly the blocks it should, retention priorities and their
durations first; a Hypothesis machine drives every policy through random pool traffic."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.config import EVICTION_POLICIES, CacheConfig, OptionError
from kvserve.core.block_hash import hash_block, root_hash
from kvserve.core.block_pool import BlockPool
from kvserve.core.retention import DEFAULT_RETENTION_PRIORITY, RetentionRange

ROOT = root_hash("model", "float32")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chain(pool: BlockPool, block_ids, first_token: int = 0, parent=ROOT):
    """Register block_ids as one prefix chain (each the next block of the one before); returns
    the hashes."""
    hashes = []
    for k, b in enumerate(block_ids):
        toks = (first_token + k,)
        h = hash_block(parent, toks)
        pool.cache(b, h, parent, toks)
        hashes.append(h)
        parent = h
    return hashes


def cached_pool(policy: str, num_blocks: int = 6, clock=None) -> BlockPool:
    """Every block taken (so none is free) and cached as its own one-block chain."""
    pool = BlockPool(num_blocks, eviction_policy=policy, **({"clock": clock} if clock else {}))
    ids = pool.take(num_blocks)
    for b in ids:
        chain(pool, [b], first_token=100 * b)
    return pool


def test_lru_takes_the_block_released_longest_ago():
    pool = cached_pool("lru", 4)
    pool.release([2, 0, 3, 1])
    pool.ref([2])  # a hit takes it out; released again it is the most recent
    pool.release([2])
    assert pool.take(4) == [0, 3, 1, 2]
    pool.check_integrity({b: 1 for b in range(4)})


def test_fifo_takes_the_block_cached_earliest_however_recently_read():
    pool = cached_pool("fifo", 4)  # cached in order 0, 1, 2, 3
    pool.release([3, 2, 1, 0])
    pool.ref([0])
    pool.release([0])  # read again: LRU would now keep it longest, FIFO takes it first
    assert pool.take(4) == [0, 1, 2, 3]


def test_priority_takes_the_least_important_users_blocks_first():
    pool = cached_pool("priority", 4)
    for b, user in zip(range(4), [0, 5, -3, 5]):  # lower scheduling priority value: more important
        pool.retain(b, None, user)
    pool.retain(1, None, -3)  # shared with an important user: it keeps that user's rank
    pool.release([0, 1, 2, 3])
    assert pool.take(4) == [3, 0, 1, 2]  # 5, 0, then -3 (released in order 1 before 2)


def test_cost_takes_leaves_first_and_keeps_a_much_read_prefix():
    pool = BlockPool(6, eviction_policy="cost")
    ids = pool.take(6)
    chain(pool, ids[:3], first_token=0)  # system prompt: 0 -> 1 -> 2
    for b in ids[3:]:
        chain(pool, [b], first_token=100 * b)  # one-off blocks
    for _ in range(3):  # the system prompt is read by three more requests
        pool.ref(ids[:3])
        pool.release(ids[:3][::-1])
    pool.release(ids[::-1])
    pool.check_integrity({})
    # one-off leaves (credit 1) go first, in release order; then the prompt from its tail:
    # block 2 (a leaf, credit clock 1 + 4 * 3) before 1, which only then becomes a leaf
    assert pool.take(6) == [5, 4, 3, 2, 1, 0]


def test_cost_never_strands_a_cached_child():
    pool = BlockPool(3, eviction_policy="cost")
    ids = pool.take(3)
    chain(pool, ids[:2])
    chain(pool, [ids[2]], first_token=50)
    pool.release([ids[0]])  # the parent waits while its child is still held
    pool.release([ids[2]])
    assert pool.take(1) == [ids[2]]  # the leaf, though the parent was released first
    pool.release([ids[1]])
    assert pool.take(1) == [ids[1]]  # the child before its parent
    pool.check_integrity({ids[1]: 1, ids[2]: 1})


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_retention_priority_comes_first_under_every_policy(policy):
    pool = cached_pool(policy, 4)
    pool.retain(0, RetentionRange(0, 16, priority=90), 0)
    pool.retain(1, RetentionRange(0, 16, priority=10), 0)
    pool.release([3, 2, 1, 0])
    taken = pool.take(4)
    assert taken[0] == 1 and taken[-1] == 0  # priority 10 first, 90 last, whatever the policy


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_retention_duration_runs_out_back_to_the_default(policy):
    clock = Clock()
    pool = cached_pool(policy, 3, clock)
    pool.retain(0, RetentionRange(0, 4, priority=90, duration_s=10), 0)
    pool.release([0, 1, 2])
    assert pool.blocks[0].effective_retention(clock.now) == 90
    assert pool.take(1) != [0]
    clock.now = 10.0  # expired while waiting: ranked again at the default, oldest first under lru/fifo
    assert pool.blocks[0].effective_retention(clock.now) == DEFAULT_RETENTION_PRIORITY
    assert pool.take(2)[0] == 0 or policy in ("cost", "priority")
    pool.check_integrity({b: 1 for b in range(3)})


def test_retention_keeps_the_higher_priority_and_the_longer_duration():
    clock = Clock()
    pool = cached_pool("lru", 1, clock)
    pool.retain(0, RetentionRange(0, 4, priority=60, duration_s=5), 0)
    pool.retain(0, RetentionRange(0, 4, priority=50), 0)  # lower: ignored
    assert (pool.blocks[0].retention_priority, pool.blocks[0].retention_expiry) == (60, 5.0)
    pool.retain(0, RetentionRange(0, 4, priority=60, duration_s=20), 0)
    assert pool.blocks[0].retention_expiry == 20.0
    clock.now = 30.0
    pool.retain(0, RetentionRange(0, 4, priority=40, duration_s=1), 0)  # 60 ran out: 40 beats the default
    assert (pool.blocks[0].retention_priority, pool.blocks[0].retention_expiry) == (40, 31.0)


def test_eviction_tells_listeners_and_resets_the_bookkeeping():
    pool = cached_pool("lru", 2)
    heard = []
    pool.on_evict.add(lambda block_id, block_hash: heard.append((block_id, pool.blocks[block_id].ref_cnt)))
    pool.retain(0, RetentionRange(0, 4, priority=80), 3)
    pool.release([1, 0])
    assert pool.take(2) == [1, 0]
    assert heard == [(1, 0), (0, 0)]  # told before the block is handed out
    assert pool.num_evictions == 2 and pool.num_cached_blocks == 0
    b = pool.blocks[0]
    assert (b.effective_retention(0.0), b.user_priority, b.num_hits) == (DEFAULT_RETENTION_PRIORITY, None, 0)


def test_free_blocks_go_before_any_cached_one_under_every_policy():
    for policy in EVICTION_POLICIES:
        pool = BlockPool(4, eviction_policy=policy)
        ids = pool.take(4)
        chain(pool, ids[:2])
        pool.release(ids[::-1])
        assert pool.take(2) == [2, 3], policy


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        BlockPool(2, eviction_policy="mru")
    with pytest.raises(OptionError, match="eviction_policy must be one of"):
        CacheConfig(eviction_policy="mru")


class EvictionMachine(RuleBasedStateMachine):
    """Random take / ref / release / cache (as chains) / retain / clock steps under each policy:
    the pool's invariants hold, a free block is always taken before a cached one, and the victim
    is the lowest retention priority's first block in the policy's order as its definition says."""

    @initialize(policy=st.sampled_from(EVICTION_POLICIES))
    def setup(self, policy):
        self.clock = Clock()
        self.pool = BlockPool(10, eviction_policy=policy, clock=self.clock)
        self.tables: list[list[int]] = []
        self.num_chained = 0

    @precondition(lambda self: hasattr(self, "pool") and self.pool.num_free_blocks > 0)
    @rule(n=st.integers(1, 3), chained=st.booleans())
    def take(self, n, chained):
        ids = [self.take_one() for _ in range(min(n, self.pool.num_free_blocks))]
        if chained:
            chain(self.pool, ids, first_token=self.num_chained % 7)  # repeats: some hashes are already held
            self.num_chained += 1
        self.tables.append(ids)

    def take_one(self) -> int:
        """A free block while there is one; else a victim of the lowest retention waiting."""
        pool, now = self.pool, self.clock()
        free = list(pool._free_queue)
        lowest = min((pool.blocks[b].effective_retention(now) for b in pool.evictor), default=None)
        before = {b: pool.blocks[b].effective_retention(now) for b in pool.evictor}
        expected = None if free else min((b for b in before if before[b] == lowest), key=self.reference_key)
        (block_id,) = pool.take(1)
        assert block_id == (free[0] if free else expected)
        assert pool.blocks[block_id].block_hash is None
        return block_id

    def reference_key(self, block_id: int):
        """Each policy's order, written from its definition over the block's bookkeeping."""
        pool = self.pool
        b = pool.blocks[block_id]
        return {"lru": lambda: (b.last_used,), "fifo": lambda: (b.cached_at,),
                "priority": lambda: (-(b.user_priority or 0), b.last_used),
                "cost": lambda: (not pool.is_leaf(b), b.credit, b.last_used)}[pool.eviction_policy]()

    @precondition(lambda self: hasattr(self, "pool") and self.tables)
    @rule(k=st.integers(0, 100))
    def share(self, k):
        table = self.tables[k % len(self.tables)]
        self.pool.ref(table)
        self.tables.append(list(table))

    @precondition(lambda self: hasattr(self, "pool") and self.tables)
    @rule(k=st.integers(0, 100))
    def release(self, k):
        self.pool.release(reversed(self.tables.pop(k % len(self.tables))))

    @precondition(lambda self: hasattr(self, "pool") and self.tables)
    @rule(k=st.integers(0, 100), priority=st.integers(1, 100), duration=st.sampled_from([None, 1.0, 5.0]),
          user=st.integers(-2, 2))
    def retain(self, k, priority, duration, user):
        for b in self.tables[k % len(self.tables)]:
            self.pool.retain(b, RetentionRange(0, 1, priority, duration), user)

    @precondition(lambda self: hasattr(self, "pool"))
    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def tick(self, dt):
        self.clock.now += dt

    @invariant()
    def integrity(self):
        if not hasattr(self, "pool"):
            return
        refs: dict[int, int] = {}
        for t in self.tables:
            for b in t:
                refs[b] = refs.get(b, 0) + 1
        self.pool.check_integrity(refs)


TestEvictionMachine = EvictionMachine.TestCase
TestEvictionMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
