"""Nothing one request asks for can stall the engine (issue 32, items 1 and 8): a request is
admitted by what its whole group (n samples, beams) may hold at once, and refused at once, with
the numbers, when that can never fit; a group's beams give way and come back together; a group
that runs without progress is ended by the watchdog with the reason; a window with attention
sinks is counted by the few blocks it holds. The requests queued behind each of these complete
with their solo outputs, and the engine's invariants hold after every step.

Every test drives the engine a bounded number of steps: a wedge fails it, never hangs it."""

import pytest

from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from tests.conftest import greedy, make_engine

MAX_STEPS = 400
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
         "with her dog. One day, she saw a big red ball under a tree.")


def drive(engine, requests=(), max_steps=MAX_STEPS, each_step=None):
    """Add the requests, step until nothing is left (at most max_steps), check the invariants
    after every step; returns the finished outputs by id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        engine.check_integrity()
        engine.scheduler.check_integrity()
        if each_step is not None:
            each_step(engine)
    left = sorted(engine.scheduler.requests)
    assert not engine.has_unfinished(), f"still running after {max_steps} steps: {left}"
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks  # nothing left held
    return outs


def tokens(out):
    return [c.token_ids for c in out.outputs]


def beams(width, max_tokens=60):
    return SamplingParams(use_beam_search=True, beam_width=width, temperature=0, max_tokens=max_tokens,
                          ignore_eos=True)


@pytest.fixture(scope="module")
def prompt40(stories):
    return stories.tokenizer.encode(STORY)[:40]


@pytest.fixture(scope="module")
def normal(stories):
    """Ordinary requests that arrive behind the bad one, with their outputs run alone."""
    encode = stories.tokenizer.encode
    requests = [("tiny", encode(STORY)[:3], greedy(8)), ("cat", encode("The cat sat on the"), greedy(12)),
                ("sampled", encode("One day, Tom"), SamplingParams(temperature=0.8, seed=7, max_tokens=10))]
    solo = {rid: tokens(drive(make_engine(stories, block_size=16), [(rid, p, params)])[rid])
            for rid, p, params in requests}
    return requests, solo


def assert_served(outs, normal):
    requests, solo = normal
    for rid, _, _ in requests:
        assert outs[rid].error is None and tokens(outs[rid]) == solo[rid], rid


@pytest.mark.parametrize("params", [beams(4), SamplingParams(temperature=0.8, n=4, seed=1, max_tokens=60,
                                                               ignore_eos=True)], ids=["beams", "n"])
def test_a_group_that_can_never_fit_is_refused_at_once(stories, prompt40, normal, params):
    """8 blocks of 16; 40 prompt tokens and 60 more: 7 blocks a sequence, 2 of them the shared
    prompt's, so four sequences hold 2 + 4 * 5 == 22."""
    engine = make_engine(stories, num_blocks=8, block_size=16)
    refused = "its 4 sequences may hold 22 blocks at once but the KV cache has 8 blocks"
    with pytest.raises(ValueError, match=refused):
        engine.add_request("group", prompt40, params)
    engine.add_request("alone", prompt40, beams(1))  # one sequence of 7 blocks fits
    outs = drive(engine, normal[0])
    assert_served(outs, normal)
    assert len(outs["alone"].outputs[0].token_ids) == 60


def test_samples_without_max_tokens_are_counted_to_the_end_of_the_context(stories):
    """A chat with no max_tokens may grow to the context (512 tokens, 32 blocks): a pool of eight
    contexts holds n = 8 of them, never 9."""
    engine = make_engine(stories, num_blocks=8 * 32, block_size=16)
    prompt = stories.tokenizer.encode("Once upon a time")
    rest = engine.max_model_len - len(prompt)
    refused = "its 9 sequences may hold 288 blocks at once but the KV cache has 256 blocks"
    with pytest.raises(ValueError, match=refused):
        engine.add_request("nine", prompt, SamplingParams(temperature=0.8, n=9, max_tokens=rest))
    engine.add_request("eight", prompt, SamplingParams(temperature=0.8, n=8, max_tokens=rest))
    assert engine.abort("eight") and not engine.has_unfinished()


def test_the_watchdog_ends_a_group_that_cannot_run_and_the_rest_go_on(stories, prompt40, normal):
    """A group let in past add_request's check (as a bug there would) can never run whole: it is
    ended with the reason within the watchdog's bound, and the requests queued behind it run."""
    engine = make_engine(stories, num_blocks=8, block_size=16)
    params = beams(4)
    req = Request("wedge", prompt40, params)
    engine.scheduler.add_request(req)
    engine.outputs.add(req, None)
    engine.beams.add(req, params.max_tokens)
    outs = drive(engine, normal[0])
    wedge = outs["wedge"]
    assert wedge.error is not None and wedge.error.startswith("no progress in 64 steps")
    assert "22 blocks" in wedge.error and all(c.finish_reason == "error" for c in wedge.outputs)
    assert req.status == RequestStatus.FINISHED_ERROR
    assert_served(outs, normal)


def test_beams_give_way_together_and_come_back_together(stories):
    """A more urgent request needs the blocks the beams hold: every beam of the group is
    preempted in the same step and readmitted in the same step (no step ever runs part of
    them), and both finish as they do alone."""
    encode = stories.tokenizer.encode
    group = ("beams", encode("Lily saw a big red ball under"), beams(4, 16))  # 3 + 4 * 4 == 19 blocks at most
    urgent = ("urgent", encode(STORY)[:60], greedy(20, ignore_eos=True))  # 15 blocks to start
    solo = {rid: tokens(drive(make_engine(stories, block_size=4), [(rid, p, params)])[rid])
            for rid, p, params in (group, urgent)}
    engine = make_engine(stories, num_blocks=24, block_size=4, policy="priority")
    schedule, split = engine.scheduler.schedule, []

    def schedule_checked():
        out = schedule()
        members = engine.scheduler.groups["beams"].members if "beams" in engine.scheduler.groups else []
        live = {m.request_id for m in members if not m.is_finished}
        ran = live & {s.request_id for s in out.scheduled}
        if ran and ran != live:
            split.append(sorted(ran))
        return out

    def arrive(engine):
        if engine.num_steps == 4:
            engine.add_request(*urgent, priority=-1)

    engine.scheduler.schedule = schedule_checked
    outs = drive(engine, [group], each_step=arrive)
    assert not split, f"steps that ran part of the beams: {split}"
    assert engine.scheduler.num_preemptions == 4  # the four beams gave way, once
    assert {rid: tokens(o) for rid, o in outs.items()} == solo


def test_a_window_with_sinks_is_admitted_for_what_it_holds(stories):
    """Window 64 with 4 sinks, blocks of 16: a sequence of any length holds at most 6 blocks
    between steps, so a 1,700-token prompt fits a pool of 100 (its prompt goes in the chunks the
    pool can hold) and decodes as it does with a pool that takes the prompt in one step."""
    options = dict(block_size=16, sliding_window=64, attention_sinks=4)
    prompt = (stories.tokenizer.encode(STORY) * 60)[:1700]
    request = ("long", prompt, greedy(20, ignore_eos=True))
    engine = make_engine(stories, num_blocks=100, **options)
    assert engine.kv.blocks_needed(1720, 1) == 6
    held = []
    outs = drive(engine, [request], each_step=lambda e: held.append(e.kv.num_held_blocks("long")))
    assert held and max(held) <= 6
    roomy = drive(make_engine(stories, num_blocks=200, **options), [request])
    assert tokens(outs["long"]) == tokens(roomy["long"]) and len(outs["long"].outputs[0].token_ids) == 20


def test_speculative_lookahead_counts_toward_what_a_window_holds(stories):
    """A decode that verifies k proposals computes 1 + k tokens in one step: window 64 with 4
    sinks holds 1 + cdiv(60 + k - 1, 16) + 1 blocks then, 6 up to k = 5 and 7 from k = 6. A pool of
    6 takes the first and refuses the second; the prompt goes in the chunks that fit."""
    window = dict(block_size=16, sliding_window=64, attention_sinks=4)
    options = dict(window, speculative="ngram")
    prompt = (stories.tokenizer.encode(STORY) * 10)[:300]
    request = ("long", prompt, greedy(30, ignore_eos=True))
    refused = "it may hold 7 blocks at once but the KV cache has 6 blocks"
    with pytest.raises(ValueError, match=refused):
        make_engine(stories, num_blocks=6, num_speculative_tokens=6, **options).add_request(*request)
    engine = make_engine(stories, num_blocks=6, num_speculative_tokens=5, **options)
    outs = drive(engine, [request])
    assert engine.num_spec_proposed > 0  # it did verify proposals
    plain = drive(make_engine(stories, num_blocks=200, **window), [request])
    assert tokens(outs["long"]) == tokens(plain["long"])
