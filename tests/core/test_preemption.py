"""Preemption that chooses: swap or recompute per victim by their measured costs (auto), the
fixed modes as asked, victims by priority then the cheapest to bring back, each choice counted
with its reason."""

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.preemption import (INITIAL_PREFILL_TOKENS_PER_S, SMOOTHING, AutoPreemption, PreemptionCosts,
                                     RecomputePreemption, SwapPreemption, Victim)
from kvserve.core.request import RequestStatus
from tests.core.factories import fake_step, make_request, make_scheduler


def test_measurements_replace_the_estimates_then_are_smoothed():
    costs = PreemptionCosts(block_bytes=1000)
    assert costs.recompute_s(INITIAL_PREFILL_TOKENS_PER_S) == pytest.approx(1.0)
    costs.observe_prefill(500, 1.0)
    assert costs.prefill_tokens_per_s == 500
    costs.observe_prefill(1500, 1.0)
    assert costs.prefill_tokens_per_s == pytest.approx((1 - SMOOTHING) * 500 + SMOOTHING * 1500)
    costs.observe_copy(4000, 2.0)
    assert costs.swap_s(3) == pytest.approx(2 * 3 * 1000 / 2000)  # out now and back in later
    costs.observe_copy(0, 1.0)  # nothing copied: no measurement
    assert costs.num_copy_samples == 1


def test_auto_takes_the_cheaper_way_and_says_why():
    costs = PreemptionCosts(block_bytes=1000, prefill_tokens_per_s=100, copy_bytes_per_s=10_000)
    auto = AutoPreemption(costs)
    # 20 tokens: 0.2 s to recompute; 2 blocks: 0.4 s to swap out and in
    assert auto.choose(Victim(20, 2, can_swap=True, is_gang=False)) == (False, "recompute_cheaper")
    # 200 tokens in 2 blocks' worth: 2 s to recompute
    assert auto.choose(Victim(200, 2, can_swap=True, is_gang=False)) == (True, "swap_cheaper")
    assert auto.choose(Victim(200, 2, can_swap=False, is_gang=False)) == (False, "no_host_room")
    assert auto.choose(Victim(200, 2, can_swap=True, is_gang=True)) == (False, "beams")
    assert RecomputePreemption(costs).choose(Victim(200, 2, True, False)) == (False, "mode")
    assert SwapPreemption(costs).choose(Victim(20, 2, True, False)) == (True, "mode")
    assert SwapPreemption(costs).choose(Victim(20, 2, False, False)) == (False, "no_host_room")


def test_auto_is_the_default_mode():
    assert SchedulerConfig().preemption_mode == "auto"
    with pytest.raises(ValueError, match="preemption mode must be one of"):
        SchedulerConfig(preemption_mode="sometimes")


def run_under_pressure(prefill_tokens_per_s, copy_bytes_per_s, mode="auto", cpu_blocks=8):
    """Two requests that outgrow a 4-block pool; returns the scheduler and what b went through."""
    sched = make_scheduler(num_blocks=4, block_size=4, cpu_blocks=cpu_blocks, preemption_mode=mode)
    costs = sched.preemption.costs
    costs.block_bytes, costs.prefill_tokens_per_s, costs.copy_bytes_per_s = 1000, prefill_tokens_per_s, copy_bytes_per_s
    a, b = make_request(range(4), max_tokens=6), make_request(range(10, 14), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    statuses = set()
    while sched.has_unfinished():
        fake_step(sched)
        statuses.add(b.status)
    assert a.num_output_tokens == b.num_output_tokens == 6
    assert sched.kv.pool.num_free_blocks == 4
    return sched, statuses


def test_auto_swaps_where_copying_is_cheap_and_recomputes_where_prefill_is():
    sched, statuses = run_under_pressure(prefill_tokens_per_s=10, copy_bytes_per_s=1e9)
    assert RequestStatus.SWAPPED in statuses
    assert set(sched.preemption_choices) == {("swap", "swap_cheaper")}
    sched, statuses = run_under_pressure(prefill_tokens_per_s=1e9, copy_bytes_per_s=10)
    assert RequestStatus.SWAPPED not in statuses and RequestStatus.PREEMPTED in statuses
    assert set(sched.preemption_choices) == {("recompute", "recompute_cheaper")}
    sched, _ = run_under_pressure(prefill_tokens_per_s=10, copy_bytes_per_s=1e9, cpu_blocks=0)
    assert set(sched.preemption_choices) == {("recompute", "no_host_room")}
    assert sum(sched.preemption_choices.values()) == sched.num_preemptions


def test_the_victim_is_the_cheapest_to_bring_back_among_equals():
    """fcfs: every request is of one priority; the one with the least to recompute goes, though it
    arrived first (the policy's own order would take the last arrival)."""
    sched = make_scheduler(num_blocks=6, block_size=4, preemption_mode="recompute", max_num_batched_tokens=64)
    short, long = make_request(range(3), max_tokens=8, arrival=0.0), make_request(range(20, 31), max_tokens=8,
                                                                                  arrival=1.0)
    sched.add_request(short)
    sched.add_request(long)
    fake_step(sched)  # short holds 1 block (3 + 1 tokens), long 3 (11 + 1)
    while sched.num_preemptions == 0:
        fake_step(sched)
    assert short.num_preemptions == 1 and long.num_preemptions == 0
