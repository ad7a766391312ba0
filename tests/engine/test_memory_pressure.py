"""Under memory pressure greedy tokens stay those of solo runs: every eviction policy, every
preemption mode (auto included), with retention priorities; the costs auto weighs are measured."""

import pytest

from kvserve.config import EVICTION_POLICIES
from kvserve.engine.kv_state import kv_state
from tests.conftest import greedy, make_engine
from tests.engine.test_batching import run_all, varied_prompts

SYSTEM = "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog. "


@pytest.fixture(scope="module")
def workload(stories):
    """A shared system prompt before each user's words, and each prompt's solo greedy tokens."""
    tok = stories.tokenizer
    system = tok.encode(SYSTEM)
    prompts = [system + p[1:] for p in varied_prompts(tok, 6, seed=3, max_words=10)]
    lengths = [5 + (i * 5) % 7 for i in range(len(prompts))]
    engine = make_engine(stories, num_blocks=256, block_size=8)
    outs = [run_all(engine, [p], greedy(n, ignore_eos=True))[0] for p, n in zip(prompts, lengths)]
    return prompts, lengths, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_every_eviction_policy_keeps_greedy_tokens(stories, workload, policy):
    prompts, lengths, expected = workload
    engine = make_engine(stories, num_blocks=14, block_size=8, eviction_policy=policy, max_num_seqs=2)
    outs = run_all(engine, prompts, [greedy(n, ignore_eos=True) for n in lengths])
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats.num_evictions > 0 and stats.scheduler.prefix_hit_rate > 0  # pressure, and hits despite it
    assert kv_state(engine)["eviction_policy"] == policy


@pytest.mark.parametrize("mode", ["auto", "recompute", "swap"])
def test_every_preemption_mode_keeps_greedy_tokens(stories, workload, mode):
    prompts, lengths, expected = workload
    engine = make_engine(stories, num_blocks=12, block_size=8, preemption_mode=mode, max_num_batched_tokens=64,
                         swap_space=1 << 22)
    outs = run_all(engine, prompts, [greedy(n, ignore_eos=True) for n in lengths])
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats.scheduler.num_preemptions > 0
    assert sum(n for _, _, n in stats.preemption_choices) == stats.scheduler.num_preemptions
    assert {(m, why) for m, why, _ in stats.preemption_choices} <= {
        "auto": {("swap", "swap_cheaper"), ("recompute", "recompute_cheaper"), ("recompute", "no_host_room")},
        "recompute": {("recompute", "mode")}, "swap": {("swap", "mode"), ("recompute", "no_host_room")}}[mode]
    costs = engine.scheduler.preemption.costs
    assert costs.num_prefill_samples > 0 and costs.prefill_tokens_per_s > 0  # measured as it ran
    if stats.num_swaps_out:
        assert costs.num_copy_samples > 0
    assert engine.kv.cpu_pool is None or engine.kv.cpu_pool.num_free_blocks == engine.kv.cpu_pool.num_blocks


@pytest.mark.parametrize("prefill_fast", [True, False])
def test_auto_follows_the_measured_costs(stories, workload, prefill_fast):
    """Measurements pinned (a model whose prefill is far faster, or far slower, than copying):
    auto recomputes, or swaps, every victim, with the same tokens either way."""
    prompts, lengths, expected = workload
    engine = make_engine(stories, num_blocks=12, block_size=8, max_num_batched_tokens=64, swap_space=1 << 22)
    costs = engine.scheduler.preemption.costs
    costs.observe_prefill = costs.observe_copy = lambda *a: None  # keep the pinned speeds
    costs.prefill_tokens_per_s, costs.copy_bytes_per_s = (1e12, 1.0) if prefill_fast else (1e-3, 1e12)
    outs = run_all(engine, prompts, [greedy(n, ignore_eos=True) for n in lengths])
    assert [o.outputs[0].token_ids for o in outs] == expected
    reasons = {why for _, why, _ in engine.stats().preemption_choices}
    assert reasons == ({"recompute_cheaper"} if prefill_fast else {"swap_cheaper"})


def test_retained_system_prompt_is_shown_and_outlives_the_rest(stories, workload):
    prompts, lengths, expected = workload
    engine = make_engine(stories, num_blocks=14, block_size=8, max_num_seqs=2)
    system_len = len(stories.tokenizer.encode(SYSTEM)) - 1
    keep = greedy(lengths[0], ignore_eos=True, kv_retention=[{"start": 0, "end": system_len, "priority": 90}])
    first = run_all(engine, prompts[:1], [keep])
    assert first[0].outputs[0].token_ids == expected[0]
    state = kv_state(engine)
    kept = [b for b, p in enumerate(state["blocks"]["retention"]) if p == 90]
    assert len(kept) == -(-system_len // 8) and all(state["blocks"]["status"][b] == "c" for b in kept)
    outs = run_all(engine, prompts[1:], [greedy(n, ignore_eos=True) for n in lengths[1:]])
    assert [o.outputs[0].token_ids for o in outs] == expected[1:]
    assert engine.stats().num_evictions > 0
    state = kv_state(engine)
    assert all(state["blocks"]["retention"][b] == 90 and state["blocks"]["hashed"][b] == "1" for b in kept)
