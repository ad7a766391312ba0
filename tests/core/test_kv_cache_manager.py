from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.core.factories import make_manager, make_request


def admit(kv, req):
    blocks, n = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - n, blocks)
    req.num_computed_tokens = req.num_tokens
    return n


def test_allocation_is_on_demand_and_free_returns_everything():
    kv = make_manager(num_blocks=8, block_size=4)
    req = make_request(range(10))
    assert admit(kv, req) == 0
    assert len(kv.block_table(req.request_id)) == 3  # 10 tokens -> 3 blocks, no more
    req.append_token(99)
    assert kv.allocate_slots(req, 1)
    req.num_computed_tokens += 1
    assert len(kv.block_table(req.request_id)) == 3  # slot 11 of 12: same block
    kv.free(req)
    assert kv.pool.num_free_blocks == 8
    kv.check_integrity()


def test_failed_allocation_changes_nothing():
    kv = make_manager(num_blocks=2, block_size=4)
    req = make_request(range(12))
    assert not kv.allocate_slots(req, 12)
    assert kv.pool.num_free_blocks == 2 and kv.block_table(req.request_id) == []
    kv.check_integrity()


def test_prefix_hit_shares_full_blocks_and_keeps_last_token_computed():
    kv = make_manager(num_blocks=16, block_size=4)
    a = make_request(range(12))
    admit(kv, a)
    b = make_request(list(range(12)))  # identical prompt: a full hit must leave one token
    blocks, n = kv.find_cached_prefix(b)
    assert n == 8 and blocks == [kv.block_table(a.request_id)[:2]]  # one list per cache group
    c = make_request(list(range(8)) + [50, 51, 52])
    assert kv.find_cached_prefix(c)[1] == 8
    d = make_request([0, 1, 2, 9] + list(range(4, 12)))  # differs in block 0: nothing shared
    assert kv.find_cached_prefix(d)[1] == 0


def test_freed_blocks_stay_cached_until_evicted():
    kv = make_manager(num_blocks=4, block_size=4)
    a = make_request(range(9))
    admit(kv, a)
    kv.free(a)
    b = make_request(range(9))
    assert kv.find_cached_prefix(b)[1] == 8
    filler = make_request(range(100, 116))  # takes all 4 blocks: evicts the cached ones
    admit(kv, filler)
    kv.free(filler)
    assert kv.find_cached_prefix(make_request(range(9)))[1] == 0


def test_cache_salt_and_namespace_isolate():
    kv = make_manager(num_blocks=16, block_size=4)
    admit(kv, make_request(range(9), salt="tenant-a"))
    assert kv.find_cached_prefix(make_request(range(9), salt="tenant-a"))[1] == 8
    assert kv.find_cached_prefix(make_request(range(9), salt="tenant-b"))[1] == 0
    assert kv.find_cached_prefix(make_request(range(9)))[1] == 0
    # a different KV dtype (or model) is a different namespace: the same blocks never hit
    other = make_manager(num_blocks=16, block_size=4, namespace=("m", "float32", "bfloat16", None))
    other.pool = kv.pool
    assert other.find_cached_prefix(make_request(range(9), salt="tenant-a"))[1] == 0


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    kv = make_manager(num_blocks=8, block_size=4)
    parent = make_request(range(6))
    admit(kv, parent)
    child = make_request(range(6))
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    shared = kv.block_table(parent.request_id)
    assert kv.block_table(child.request_id) == shared
    assert all(kv.pool.blocks[b].ref_cnt == 2 for b in shared)
    child.append_token(1)
    assert kv.allocate_slots(child, 1)  # writes slot 6 of the shared partial block 1
    copies = kv.take_copies()
    assert copies.copy_on_write == [(shared[1], kv.block_table(child.request_id)[1])]
    assert kv.block_table(child.request_id)[0] == shared[0]  # the full block stays shared
    parent.append_token(2)
    assert kv.allocate_slots(parent, 1)  # now the parent owns block 1 alone: no copy
    assert not kv.take_copies()
    kv.check_integrity()


def test_swap_out_and_in_round_trip():
    kv = make_manager(num_blocks=4, block_size=4, cpu_blocks=4)
    req = make_request(range(7))
    admit(kv, req)
    gpu = kv.block_table(req.request_id)
    assert kv.swap_out(req)
    assert kv.pool.num_free_blocks == 4 and kv.block_table(req.request_id) == []
    req.append_token(5)
    assert kv.swap_in(req, 1)
    copies = kv.take_copies()
    assert [g for g, _ in copies.swap_out] == gpu
    assert [c for c, _ in copies.swap_in] == [c for _, c in copies.swap_out]
    kv.check_integrity()


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admit / append / fork / free over a small pool (evicting as it goes): integrity
    always holds, hits hold exactly the request's tokens, and nothing leaks."""

    def __init__(self):
        super().__init__()
        self.kv = make_manager(num_blocks=12, block_size=2)
        self.live = []

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 9), salt=st.sampled_from([None, "s"]))
    def admit(self, prefix, length, salt):
        tokens = [prefix] * 3 + list(range(length))
        req = make_request(tokens, salt=salt)
        blocks, n = self.kv.find_cached_prefix(req)
        for i, b in enumerate(blocks[0]):
            assert self.kv.pool.blocks[b].token_ids == tuple(tokens[2 * i:2 * i + 2])
        assert n < len(tokens)
        if self.kv.allocate_slots(req, len(tokens) - n, blocks):
            req.num_computed_tokens = len(tokens)
            self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(k=st.integers(0, 50), tok=st.integers(0, 3))
    def append(self, k, tok):
        req = self.live[k % len(self.live)]
        req.append_token(tok)
        if self.kv.allocate_slots(req, 1):
            req.num_computed_tokens += 1
        else:
            req.truncate_output(req.num_output_tokens - 1)
        self.kv.take_copies()

    @precondition(lambda self: self.live)
    @rule(k=st.integers(0, 50))
    def fork(self, k):
        parent = self.live[k % len(self.live)]
        child = make_request(parent.prompt_token_ids, output=parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(k=st.integers(0, 50))
    def free(self, k):
        self.kv.free(self.live.pop(k % len(self.live)))

    @invariant()
    def integrity(self):
        self.kv.check_integrity()
        for req in self.live:  # every table covers exactly its computed tokens
            assert len(self.kv.block_table(req.request_id)) == -(-req.num_computed_tokens // 2)

    def teardown(self):
        for req in self.live:
            self.kv.free(req)
        assert self.kv.pool.num_free_blocks == 12  # no block leaked
        self.kv.check_integrity()


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_a_window_takes_a_long_prompt_in_the_chunks_that_fit():
    """allocate_fitting: a prompt too long for the pool in one step goes in the most tokens that
    fit; once the window has passed them, their blocks come back for the rest."""
    from kvserve.core.cache_group import CacheGroupSpec
    kv = make_manager(num_blocks=6, block_size=4, groups=(CacheGroupSpec("sliding", (0,), window=8, sinks=2),))
    null = kv.null_block
    req = make_request(range(30))
    assert kv.allocate_fitting(req, 30) == 24  # 30 tokens would take 8 blocks of the 6
    assert kv.block_table(req.request_id) == [0, 1, 2, 3, 4, 5]
    req.num_computed_tokens = 24
    kv.remove_skipped_blocks(req)  # the sinks' block and the recent ones stay
    assert kv.block_table(req.request_id) == [0, null, null, null, 4, 5]
    assert kv.allocate_fitting(req, 6) == 6
    assert kv.block_table(req.request_id) == [0, null, null, null, 4, 5, 3, 2]
    kv.check_integrity()


def test_full_attention_takes_all_of_a_chunk_or_nothing():
    kv = make_manager(num_blocks=6, block_size=4)
    req = make_request(range(30))
    assert kv.allocate_fitting(req, 30) == 0  # every block stays: a shorter chunk only defers the need
    assert kv.block_table(req.request_id) == [] and kv.pool.num_free_blocks == 6
    kv.check_integrity()


def test_a_group_counts_every_member_and_its_shared_prompt_once():
    from kvserve.core.cache_group import CacheGroupSpec
    assert make_manager(block_size=16).group_blocks_needed(40, 100, 4) == 2 + 4 * 5
    assert make_manager(block_size=16).group_blocks_needed(40, 100, 1) == 7
    # a window shares nothing it passes: 4 * (1 sinks' block + 4 for the recent 60 and a step)
    sinks = make_manager(block_size=16, groups=(CacheGroupSpec("sliding", (0,), window=64, sinks=4),))
    assert sinks.group_blocks_needed(40, 1720, 4, 1) == 4 * 6
    assert sinks.blocks_needed(1720, 1) == 6 and sinks.blocks_needed(1720, 2048) == 108
