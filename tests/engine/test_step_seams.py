"""The step's seams on real models (fp32): layers split over cache groups, proposed tokens
verified in one pass with the rejected ones taken back, rollback, forks in the middle of a
generation, and logits for every row asked for. Each is held to the plain engine's output."""

import pytest
import torch

from kvserve.core.cache_group import CacheGroupSpec
from kvserve.core.request import RequestStatus
from kvserve.engine import llm_engine
from tests.conftest import greedy, make_engine, run_collecting_logits

PROMPTS = ["Once upon a time", "Tom had a big dog", "The sun was hot and", "Lily saw a bird in the garden"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stories_prompts(stories):
    return [stories.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(stories, stories_prompts):
    engine = make_engine(stories, block_size=4, num_blocks=128)
    outs, logits = run_collecting_logits(engine, stories_prompts, greedy(MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], list(logits.values())


def drive(engine, prompts, params, before_step):
    """Run to completion, calling before_step(engine, step) before every step and checking the
    scheduler's invariants after it; returns each prompt's finished output."""
    ids = [engine.add_request(None, p, params) for p in prompts]
    done, step = {}, 0
    while engine.has_unfinished():
        before_step(engine, step)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_integrity()
        step += 1
    assert engine.kv.pool.num_used_blocks == 0
    return [done[i] for i in ids], step


def decoding(engine):
    return [r for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]


def test_layers_split_over_two_cache_groups_give_the_same_output(tiny_llama, monkeypatch):
    prompts = [[5, 9, 13, 2, 7, 7, 1, 30, 4], [5, 9, 13, 2, 7, 7, 1, 30, 9, 9, 12], [40, 41]]
    params = greedy(20, ignore_eos=True)
    one = make_engine(tiny_llama, block_size=4, num_blocks=64)
    ref_out, ref_logits = run_collecting_logits(one, prompts, params)
    monkeypatch.setattr(llm_engine, "cache_groups",
                        lambda config, cache, max_len: (CacheGroupSpec("full", (0, 2)), CacheGroupSpec("full", (1, 3))))
    two = make_engine(tiny_llama, block_size=4, num_blocks=128)
    assert two.kv.num_groups == 2 and len(two.storage.k) == 2  # tensor j holds layer j of each group
    assert two.plan.block_bytes * 2 == one.plan.block_bytes
    out, logits = run_collecting_logits(two, prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref_out]
    for a, b in zip(ref_logits.values(), logits.values()):
        assert (torch.stack(a) - torch.stack(b)).abs().max().item() < 1e-5
    assert out[1].num_cached_tokens == 8  # the shared prefix hit in both groups
    assert out[0].metrics.num_kv_blocks == 2 * ref_out[0].metrics.num_kv_blocks


def test_proposals_verified_in_one_pass_leave_greedy_output_unchanged(stories, stories_prompts, plain):
    """Each decode gets the next 4 tokens of the known answer as proposals, every third set with
    a wrong second token: accepted ones save steps, rejected ones are taken back."""
    expected, expected_logits = plain
    answers = {}
    counts = {"proposed": 0}

    def propose(engine, step):
        for req in decoding(engine):
            answer = answers.setdefault(req.request_id, expected[int(req.request_id)])
            guess = list(answer[req.num_output_tokens:req.num_output_tokens + 4])
            if step % 3 == 0 and len(guess) > 1:
                guess[1] = (guess[1] + 1) % 512
            req.spec_token_ids = guess
            counts["proposed"] += len(guess)

    engine = make_engine(stories, block_size=4, num_blocks=128)
    hooked = {}
    engine.runner.on_logits.add(lambda ids, rows: [hooked.setdefault(i, []).append(r.clone()) for i, r in zip(ids, rows)])
    outs, steps = drive(engine, stories_prompts, greedy(MAX_TOKENS, ignore_eos=True), propose)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert steps < MAX_TOKENS - 4 and counts["proposed"] > 0
    for rid, ref in zip(sorted(hooked, key=int), expected_logits):  # the rows that chose each token
        assert (torch.stack(hooked[rid]) - torch.stack(ref)).abs().max().item() < 1e-4


@pytest.mark.parametrize("caching", [True, False])
def test_rollback_then_continue_recomputes_the_same_tokens(stories, stories_prompts, plain, caching):
    """Half-way, each request gives back its last 5 outputs and 9 computed tokens (crossing
    blocks of 4); greedy decoding then produces them again, through rewritten K/V. Two requests
    share a prompt, so with prefix caching the rolled-back blocks are shared ones too."""
    expected, _ = plain
    prompts = stories_prompts + [stories_prompts[0]]
    rolled = set()

    def roll_back(engine, step):
        for req in decoding(engine):
            if req.request_id not in rolled and req.num_output_tokens >= 12:
                keep = req.num_output_tokens - 5
                engine.scheduler.rollback(req, req.num_prompt_tokens + keep - 4, keep)
                rolled.add(req.request_id)

    engine = make_engine(stories, block_size=4, num_blocks=128, enable_prefix_caching=caching)
    outs, _ = drive(engine, prompts, greedy(MAX_TOKENS, ignore_eos=True), roll_back)
    assert [o.outputs[0].token_ids for o in outs] == expected + [expected[0]]
    assert len(rolled) == len(prompts)


def test_fork_in_the_middle_of_a_generation(stories, stories_prompts, plain):
    """After 7 outputs a greedy request forks two more members of its group: all three share
    its blocks (copy-on-write on the partial one) and finish with the plain answer."""
    expected, _ = plain
    forked = []

    def fork(engine, step):
        for req in decoding(engine):
            if req.num_output_tokens == 7 and req.sample_index == 0 and not forked:
                forked.extend(engine.scheduler.fork(req, 2))
                tables = {tuple(engine.kv.block_table(r.request_id)) for r in req.group.members}
                assert len(tables) == 1

    engine = make_engine(stories, block_size=4, num_blocks=128)
    outs, _ = drive(engine, stories_prompts[:1], greedy(MAX_TOKENS, ignore_eos=True), fork)
    assert [c.token_ids for c in outs[0].outputs] == [expected[0]] * 3
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in forked)


def test_runner_returns_logits_for_every_row_asked_for(stories, stories_prompts):
    """A prompt chunk that asks for all its rows gets the logits a no-cache full pass gives."""
    prompt = stories_prompts[3]
    reference = make_engine(stories, use_cache=False)
    cached = make_engine(stories, block_size=4, num_blocks=64)
    rows = {}
    for name, engine in (("reference", reference), ("cached", cached)):
        engine.add_request("r", prompt, greedy(1))
        out = engine.scheduler.schedule()
        out.scheduled[0].num_logit_rows = len(prompt)
        rows[name] = engine.runner.execute(out).logits["r"]
    assert rows["cached"].shape == (len(prompt), stories.config.vocab_size)
    assert (rows["cached"] - rows["reference"]).abs().max().item() < 1e-4
