"""The tiers below the pool as byte stores: bounded by bytes, blocks forgotten in the order the
pool's eviction policy ranks them (exact victims per policy), the disk tier's files found again by a new tier on the same directory and namespace, and
a truncated, corrupt or misnamed file skipped with a warning, never returned."""

import logging

import pytest
import torch

from kvserve.core.eviction import Block, make_policy
from kvserve.kv.tiers import BlockFacts, DiskTier, HostTier, TierBlock, decode_block, encode_block, namespace_id

NAMESPACE = {"model": "m", "dtype": "float32", "kv_cache_dtype": "float32", "block_size": 4}


def make_block(i: int, nbytes: int = 100) -> TierBlock:
    data = torch.arange(nbytes, dtype=torch.int64).add(i).remainder(256).to(torch.uint8)
    return TierBlock(bytes([i]) * 34, bytes([i + 100]) * 34, (i, i + 1, i + 2, i + 3), data)


def same(a: TierBlock, b: TierBlock) -> bool:
    return (a.name, a.parent, a.token_ids) == (b.name, b.parent, b.token_ids) and torch.equal(a.data, b.data)


def test_host_tier_forgets_least_recently_used_past_its_bytes():
    tier = HostTier(250)
    assert tier.put(make_block(1)) == [] and tier.put(make_block(2)) == []
    assert tier.get(make_block(1).name) is not None  # 1 is now the most recent
    assert tier.put(make_block(3)) == [make_block(2).name]
    assert tier.names() == [make_block(1).name, make_block(3).name]
    assert tier.num_bytes == 200 and tier.get(make_block(2).name) is None
    assert tier.put(make_block(4, nbytes=300)) == [] and make_block(4).name not in tier  # larger than the budget
    tier.check_integrity()


def test_disk_tier_round_trip_and_a_new_tier_finds_the_files_oldest_first(tmp_path):
    tier = DiskTier(tmp_path, NAMESPACE, 10_000)
    blocks = [make_block(i) for i in range(3)]
    for b in blocks:
        tier.put(b)
    tier.get(blocks[0].name)  # touched, but file times order a new tier's index
    assert same(tier.get(blocks[1].name), blocks[1])
    tier.check_integrity()
    again = DiskTier(tmp_path, NAMESPACE, 10_000)
    assert again.names() == [b.name for b in blocks] and again.num_bytes == tier.num_bytes
    assert all(same(again.get(b.name), b) for b in blocks)
    smaller = DiskTier(tmp_path, NAMESPACE, tier.cost(blocks[0]) * 2)  # a smaller budget: the oldest go
    assert smaller.names() == [b.name for b in blocks[1:]]
    smaller.check_integrity()


def test_disk_tier_of_another_namespace_reads_nothing(tmp_path):
    DiskTier(tmp_path, NAMESPACE, 10_000).put(make_block(1))
    other = DiskTier(tmp_path, {**NAMESPACE, "kv_cache_dtype": "int8"}, 10_000)
    assert len(other) == 0 and other.get(make_block(1).name) is None
    assert namespace_id(NAMESPACE) != namespace_id({**NAMESPACE, "model": "n"})


@pytest.mark.parametrize("damage", ["truncate", "flip", "rename"])
def test_a_damaged_file_is_skipped_with_a_warning_and_removed(tmp_path, caplog, damage):
    tier = DiskTier(tmp_path, NAMESPACE, 10_000)
    block, other = make_block(1), make_block(2)
    tier.put(block)
    tier.put(other)
    path = tier.path(block.name)
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[:-7])
    elif damage == "flip":
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    else:  # another block's file under this block's name
        path.write_bytes(tier.path(other.name).read_bytes())
    fresh = DiskTier(tmp_path, NAMESPACE, 10_000)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert fresh.get(block.name) is None
    assert "skipping KV tier file" in caplog.text
    assert not path.exists() and block.name not in fresh and same(fresh.get(other.name), other)
    assert fresh.num_skipped == 1
    fresh.check_integrity()


def test_decode_refuses_what_is_not_a_block_file():
    with pytest.raises(ValueError, match="magic"):
        decode_block(b"hello", b"x")
    raw = encode_block(make_block(1))
    assert same(decode_block(raw, make_block(1).name), make_block(1))
    with pytest.raises(ValueError, match="truncated"):
        decode_block(raw + b"\0", make_block(1).name)


# ---- the pool's eviction policies in a tier ----

class Clock:
    """The pool's clock as a tier sees it (retention durations run on it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def named(i: int) -> bytes:
    return bytes([i]) * 34


def block_of(i: int, parent: int = 200, **facts) -> TierBlock:
    """Block i (100 bytes) under parent i (a name no test block has, by default), with these facts."""
    return TierBlock(named(i), named(parent), (i,) * 4, torch.full((100,), i, dtype=torch.uint8), BlockFacts(**facts))


def tier_of(policy: str, num_blocks: int, clock=None) -> HostTier:
    return HostTier(100 * num_blocks, make_policy(policy), clock or Clock())


def fill(tier: HostTier, blocks: list[TierBlock]) -> None:
    for b in blocks:
        assert tier.put(b) == []


@pytest.mark.parametrize("policy, victim", [("lru", 2), ("fifo", 1), ("priority", 2), ("cost", 2)])
def test_a_read_keeps_a_block_except_under_fifo(policy, victim):
    tier = tier_of(policy, 3)
    fill(tier, [block_of(1), block_of(2), block_of(3)])
    assert tier.get(named(1)) is not None  # just read: fifo still drops it, being stored first
    assert tier.put(block_of(4)) == [named(victim)]
    assert tier.eviction_policy == policy
    tier.check_integrity()


def test_fifo_drops_in_the_order_stored_however_often_read():
    tier = tier_of("fifo", 3)
    fill(tier, [block_of(1), block_of(2), block_of(3)])
    for name in (named(2), named(1), named(1)):
        tier.get(name)
    assert [tier.put(block_of(i))[0] for i in (4, 5, 6)] == [named(1), named(2), named(3)]


def test_lru_drops_the_least_recently_read():
    tier = tier_of("lru", 3)
    fill(tier, [block_of(1), block_of(2), block_of(3)])
    for name in (named(3), named(1), named(2)):
        tier.get(name)
    assert [tier.put(block_of(i))[0] for i in (4, 5, 6)] == [named(3), named(1), named(2)]


def test_priority_drops_the_least_important_users_blocks_first():
    tier = tier_of("priority", 3)
    fill(tier, [block_of(1, user_priority=0), block_of(2, user_priority=5), block_of(3, user_priority=1)])
    tier.get(named(2))  # read last, yet its user matters least
    assert tier.put(block_of(4, user_priority=0)) == [named(2)]
    assert tier.put(block_of(5, user_priority=0)) == [named(3)]
    assert tier.put(block_of(6, user_priority=0)) == [named(1)]  # among equals: the least recently read


@pytest.mark.parametrize("policy", ["lru", "fifo", "priority", "cost"])
def test_a_retained_block_outlives_the_others_until_its_duration_runs_out(policy):
    clock = Clock()
    tier = tier_of(policy, 3, clock)
    fill(tier, [block_of(1, retention_priority=90, retention_expiry=10.0), block_of(2, retention_priority=90),
                block_of(3)])
    assert tier.put(block_of(4)) == [named(3)]
    assert tier.put(block_of(5)) == [named(4)]  # default blocks go while the retained ones wait
    clock.now = 10.0  # block 1's priority falls back to the default; block 2's holds
    assert tier.put(block_of(6)) == [named(1)]
    assert set(tier.names()) == {named(2), named(5), named(6)}
    tier.check_integrity()


def test_a_low_retention_goes_before_the_default():
    tier = tier_of("lru", 2)
    fill(tier, [block_of(1), block_of(2, retention_priority=10)])
    assert tier.put(block_of(3)) == [named(2)]


def test_cost_keeps_a_chain_head_while_its_continuation_is_stored():
    """a -> b is a chain (b continues a); x is a lone block read often. Under cost a, the cheapest,
    stays while b is stored (dropping it would strand b), b goes first as the cheapest leaf, then a;
    LRU drops a first."""
    blocks = [block_of(1, depth=0), block_of(2, parent=1, depth=1), block_of(3, depth=4, num_hits=3)]
    cost = tier_of("cost", 3)
    fill(cost, blocks)
    assert cost.put(block_of(4, depth=6)) == [named(2)]
    assert cost.put(block_of(5, depth=6)) == [named(1)]  # a leaf now, and the cheapest
    cost.check_integrity()
    lru = tier_of("lru", 3)
    fill(lru, blocks)
    assert lru.put(block_of(4)) == [named(1)]


def test_cost_prefers_deep_and_much_read_blocks():
    tier = tier_of("cost", 3)
    fill(tier, [block_of(1, depth=8), block_of(2, depth=0, num_hits=0), block_of(3, depth=2, num_hits=4)])
    assert tier.put(block_of(4, depth=0)) == [named(2)]  # credit 1 against 9 and 15
    assert tier.put(block_of(5, depth=0)) == [named(4)]  # its credit 1 is the lowest; the clock is 1 now


def test_a_block_written_down_again_keeps_the_higher_retention_and_adds_its_hits():
    tier = tier_of("cost", 3)
    fill(tier, [block_of(1, retention_priority=90, num_hits=2), block_of(2), block_of(3)])
    tier.put(block_of(1, num_hits=1, user_priority=3))  # back from the pool: no retention asked this time
    assert tier.put(block_of(4)) != [named(1)] and named(1) in tier
    record = tier._records[tier._ids[named(1)]]
    assert (record.retention_priority, record.num_hits, record.user_priority) == (90, 3, 3)


def test_facts_come_from_the_pools_block():
    block = Block(7, block_hash=b"h", parent_hash=b"p", token_ids=(1,), retention_priority=80,
                  retention_expiry=5.0, user_priority=2, num_hits=4, depth=3)
    assert BlockFacts.of(block) == BlockFacts(depth=3, num_hits=4, retention_priority=80, retention_expiry=5.0,
                                              user_priority=2)


def test_a_disk_tier_found_again_learns_parents_on_read_and_ranks_by_cost(tmp_path):
    blocks = [block_of(1), block_of(2, parent=1), block_of(3)]
    first = DiskTier(tmp_path, NAMESPACE, 10_000, make_policy("cost"))
    fill(first, blocks)
    found = DiskTier(tmp_path, NAMESPACE, 3 * first.cost(blocks[0]), make_policy("cost"))
    for b in blocks:
        assert same(found.get(b.name), b)  # block 2's parent, block 1, is known to be continued now
    found.check_integrity()
    assert found.put(block_of(4)) == [named(2)]  # the cheapest leaf: 1 waits for its continuation
    found.check_integrity()
