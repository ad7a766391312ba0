"""Retention ranges: validated with errors naming the field, carried by the blocks that cover
them once cached, and evicted after everything of lower priority."""

import pytest

from kvserve.config import OptionError
from kvserve.core.retention import RetentionRange, block_retention, parse_retention
from kvserve.core.sampling_params import SamplingParams
from tests.core.factories import make_manager, make_request


@pytest.mark.parametrize("ranges, problem", [
    ([{"start": 0, "end": 8, "priority": 101}], "priority must be an integer in \\[1, 100\\], got 101"),
    ([{"start": 0, "end": 8, "priority": 0}], "priority must be an integer in \\[1, 100\\], got 0"),
    ([{"start": 4, "end": 4, "priority": 50}], "end must be an integer > start \\(4\\), got 4"),
    ([{"start": -1, "end": 4, "priority": 50}], "start must be an integer >= 0"),
    ([{"start": 0, "end": 4, "priority": 50, "duration_s": 0}], "duration_s must be a number of seconds > 0"),
    ([{"start": 0, "end": 4, "priority": True}], "priority must be an integer"),
    ([{"start": 0, "end": 4}], "range .*: missing \\['priority'\\]"),
    ([{"start": 0, "end": 4, "priority": 5, "ttl": 3}], "range .*: unknown fields \\['ttl'\\]"),
    ({"start": 0}, "must be a list of ranges"),
    ([7], "each range must be an object"),
])
def test_bad_ranges_are_refused_naming_the_field(ranges, problem):
    with pytest.raises(OptionError, match="^kv_retention " + problem) as e:
        SamplingParams(kv_retention=ranges)
    assert e.value.field == "kv_retention"


def test_a_block_takes_the_highest_overlapping_range():
    ranges = parse_retention([{"start": 0, "end": 10, "priority": 60, "duration_s": 5},
                              {"start": 8, "end": 20, "priority": 90},
                              {"start": 0, "end": 4, "priority": 60}])
    assert block_retention(ranges, 0, 4) == RetentionRange(0, 4, 60)  # 60 forever beats 60 for 5 s
    assert block_retention(ranges, 4, 8).priority == 60
    assert block_retention(ranges, 8, 12).priority == 90  # overlaps both
    assert block_retention(ranges, 20, 24) is None


def test_cached_blocks_carry_the_requests_ranges_and_are_evicted_last():
    kv = make_manager(num_blocks=7, block_size=4)
    system = list(range(8))  # two blocks kept with priority 90 for 60 s
    keep = [{"start": 0, "end": 8, "priority": 90, "duration_s": 60}]
    a = make_request(system + [50, 51, 52, 53, 54], kv_retention=keep)
    assert kv.allocate_slots(a, a.num_tokens)
    table = kv.block_table(a.request_id)
    assert [kv.pool.blocks[b].retention_priority for b in table] == [90, 90, None, None]
    b = make_request([70 + i for i in range(8)] + [1])  # two blocks of another prompt, default priority
    assert kv.allocate_slots(b, b.num_tokens)
    kv.free(b)
    kv.free(a)
    c = make_request([90 + i for i in range(17)])  # 5 blocks: the 2 partial ones, then 3 default ones evicted
    assert kv.allocate_slots(c, c.num_tokens)
    kv.check_integrity()
    cached = {kv.pool.blocks[b].block_hash is not None for b in table[:2]}
    assert cached == {True}, "the retained system prompt outlived the default blocks"
    hit, n = kv.find_cached_prefix(make_request(system + [1]))
    assert n == 8 and hit[0] == table[:2]


def test_a_prefix_hit_extends_the_retention_of_the_blocks_it_reads():
    kv = make_manager(num_blocks=8, block_size=4)
    a = make_request(list(range(9)))
    assert kv.allocate_slots(a, a.num_tokens)
    kv.free(a)
    b = make_request(list(range(9)), kv_retention=[{"start": 0, "end": 4, "priority": 80}])
    cached, n = kv.find_cached_prefix(b)
    assert kv.allocate_slots(b, b.num_tokens - n, cached)
    first, second = kv.block_table(b.request_id)[:2]
    assert (kv.pool.blocks[first].retention_priority, kv.pool.blocks[second].retention_priority) == (80, None)
