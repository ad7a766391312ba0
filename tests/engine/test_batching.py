"""Continuous batching: outputs equal solo runs under chunked prefill, small budgets and
preemption (recompute and swap); aborts free at once; impossible requests fail clearly."""

import random

import pytest

from kvserve.engine.llm_engine import QueueFullError
from kvserve.core.sampling_params import SamplingParams
from tests.conftest import greedy, make_engine

WORDS = ("Once upon a time Lily Tom dog cat park ball sun tree happy sad big little "
         "played ran saw wanted friend mom house garden bird").split()


def varied_prompts(tok, n, seed=0, max_words=40):
    rng = random.Random(seed)
    return [tok.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))))
            for _ in range(n)]


def run_all(engine, prompts, params, check=True):
    """Every output by index; integrity checked after every step."""
    ids = [engine.add_request(None, p, params[i] if isinstance(params, list) else params)
           for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            engine.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0  # nothing leaked
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def solo(stories):
    engine = make_engine(stories, num_blocks=64)
    prompts = varied_prompts(stories.tokenizer, 32)
    lengths = [8 + (i * 7) % 25 for i in range(32)]
    outs = [run_all(engine, [p], greedy(n, ignore_eos=True))[0] for p, n in zip(prompts, lengths)]
    return prompts, lengths, [o.outputs[0].token_ids for o in outs]


def test_32_prompts_together_equal_each_alone(stories, solo):
    prompts, lengths, expected = solo
    engine = make_engine(stories, num_blocks=256, max_num_batched_tokens=24, max_prefill_chunk=16)
    outs = run_all(engine, prompts, [greedy(n, ignore_eos=True) for n in lengths])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.num_steps > max(lengths)  # the budget really forced chunking


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(stories, solo, mode):
    prompts, lengths, expected = solo
    engine = make_engine(stories, num_blocks=14, block_size=8, preemption_mode=mode,
                         max_num_batched_tokens=64, swap_space=1 << 22)
    outs = run_all(engine, prompts, [greedy(n, ignore_eos=True) for n in lengths])
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = engine.stats().scheduler
    assert stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats.num_preemptions
    if mode == "swap":
        assert engine.kv.cpu_pool.num_free_blocks == engine.kv.cpu_pool.num_blocks


def test_abort_frees_blocks_immediately(stories):
    engine = make_engine(stories, num_blocks=64)
    engine.add_request("keep", stories.tokenizer.encode("Tom had a dog"), greedy(30, ignore_eos=True))
    engine.add_request("drop", stories.tokenizer.encode("Lily saw a bird " * 8), greedy(30, ignore_eos=True))
    engine.step()
    engine.step()
    used = engine.kv.pool.num_used_blocks
    held = len(engine.kv.block_table("drop"))
    assert engine.abort("drop") and held > 0
    assert engine.kv.pool.num_used_blocks == used - held
    engine.check_integrity()
    outs = run_all(engine, [], greedy())
    assert outs == [] and not engine.has_unfinished()


def test_impossible_requests_error_clearly(stories):
    engine = make_engine(stories, num_blocks=4, block_size=16)
    tok = stories.tokenizer
    with pytest.raises(ValueError, match="KV cache has 4 blocks"):
        engine.add_request(None, tok.encode("word " * 100), greedy(10))
    with pytest.raises(ValueError, match="context holds 512"):
        make_engine(stories).add_request(None, [5] * 600, greedy(1))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request(None, [], greedy(1))
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 512\)"):
        engine.add_request(None, [1, 99999], greedy(1))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request(None, "hi", SamplingParams(temperature=-1))
    assert not engine.has_unfinished() and engine.kv.pool.num_used_blocks == 0


def test_full_waiting_queue_is_refused(stories):
    engine = make_engine(stories, max_waiting=2)
    engine.add_request(None, "a", greedy(1))
    engine.add_request(None, "b", greedy(1))
    with pytest.raises(QueueFullError):
        engine.add_request(None, "c", greedy(1))


def test_priority_request_finishes_first(stories):
    engine = make_engine(stories, max_num_seqs=2, policy="priority")
    prompt = stories.tokenizer.encode("Once upon a time")
    for i in range(4):
        engine.add_request(f"low{i}", prompt, greedy(20, ignore_eos=True), priority=1)
    engine.step()
    engine.add_request("high", prompt, greedy(20, ignore_eos=True), priority=0)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order.index("high") < order.index("low2") and order.index("high") < order.index("low3")


def test_soak_random_arrivals_aborts_and_lengths(stories):
    """A few hundred small random requests arriving over time, some aborted: every block comes
    back, and every finished output equals its solo run."""
    rng = random.Random(7)
    tok = stories.tokenizer
    engine = make_engine(stories, num_blocks=48, block_size=8, max_num_seqs=16, max_num_batched_tokens=48)
    prompts = varied_prompts(tok, 240, seed=3, max_words=12)
    plan = [(p, rng.randint(1, 24), rng.random() < 0.15) for p in prompts]
    pending = list(enumerate(plan))
    outputs, aborted, step = {}, set(), 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if pending:
                i, (p, n, _) = pending.pop(0)
                engine.add_request(str(i), p, greedy(n, ignore_eos=True))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        step += 1
        for i, (_, _, abort) in enumerate(plan):
            if abort and str(i) not in aborted and str(i) in engine.scheduler.requests and step % 3 == 0:
                engine.abort(str(i))
                aborted.add(str(i))
        engine.check_integrity()
        assert step < 5000
    assert engine.kv.pool.num_used_blocks == 0 and not engine.scheduler.requests
    ref = make_engine(stories, num_blocks=48, block_size=8)
    for rid, out in outputs.items():
        if rid in aborted:
            continue
        p, n, _ = plan[int(rid)]
        assert out.outputs[0].token_ids == run_all(ref, [p], greedy(n, ignore_eos=True), check=False)[0].outputs[0].token_ids
    assert {str(i) for i in range(240)} - aborted == set(outputs)  # every other one finished
    assert len(aborted) > 10
