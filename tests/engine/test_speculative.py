"""Speculative decoding: greedy output with guesses == plain greedy output, token for token, for
the n-gram and the draft proposer, under batching, chunked prefill, preemption and prefix
caching (both engines' invariants every step, nothing leaked); speculative sampling leaves the
target's distribution exactly as it is (a chi-square test with a stated false-failure rate);
acceptance is measured; bad choices are refused."""

import math

import pytest
import torch

from kvserve import SamplingParams
from kvserve.core.outputs import ScheduledSequence
from kvserve.runner.sampler import Sampler
from tests.conftest import greedy, make_engine

TEXT = ["Once upon a time, Lily and Tom went to the park. They played with a ball. Once upon a time, Lily",
        "Tom had a big red ball. He liked to play with the ball. The ball was big and red. Tom had a",
        "The sun was hot. Lily wanted to swim. The sun was hot and Lily",
        "Lily saw a bird in the garden. The bird was small. Lily saw a"]


def run(engine, prompts, max_tokens=30, **params):
    ids = [engine.add_request(None, p, greedy(max_tokens, ignore_eos=True, **params)) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def prompts(stories):
    return [stories.tokenizer.encode(t) for t in TEXT]


@pytest.fixture(scope="module")
def plain(stories, prompts):
    return [o.outputs[0].token_ids for o in run(make_engine(stories, block_size=4, num_blocks=256), prompts)]


SETTINGS = {"batched": dict(block_size=4, num_blocks=256),
            "chunked": dict(block_size=4, num_blocks=256, max_num_batched_tokens=12, max_prefill_chunk=5),
            "preempted": dict(block_size=4, num_blocks=40, max_num_batched_tokens=64),
            "shared-prefix": dict(block_size=4, num_blocks=256)}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_with_guesses_equals_plain_greedy(stories, stories_path, prompts, plain, method, setting):
    spec = dict(speculative=method, num_speculative_tokens=3)
    if method == "draft":
        spec["speculative_model"] = stories_path  # a draft that agrees often (itself): long accepted runs
    engine = make_engine(stories, **SETTINGS[setting], **spec)
    batch = prompts + [prompts[0]] if setting == "shared-prefix" else prompts
    outs = run(engine, batch)
    assert [o.outputs[0].token_ids for o in outs] == (plain + [plain[0]] if setting == "shared-prefix" else plain)
    assert engine.num_spec_accepted > 0 and engine.num_spec_proposed > engine.num_spec_accepted * (method == "ngram")
    if setting == "preempted":
        assert engine.stats().scheduler.num_preemptions > 0
    if method == "draft":
        draft = engine.proposer.engine
        draft.scheduler.check_integrity()
        for rid in list(draft.scheduler.groups):
            draft.abort(rid)
        assert draft.kv.pool.num_used_blocks == 0


def test_a_weak_draft_is_rejected_often_and_changes_nothing(stories, prompts, plain, tmp_path):
    """A random-weight draft with the target's vocabulary: most guesses are wrong and are taken back."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    engine = make_engine(stories, block_size=4, num_blocks=256, speculative="draft", num_speculative_tokens=4,
                         speculative_model=str(tmp_path))
    outs = run(engine, prompts)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert engine.num_spec_accepted < engine.num_spec_proposed / 2
    m = outs[0].metrics
    assert m.num_spec_proposed > 0 and m.spec_acceptance_rate == m.num_spec_accepted / m.num_spec_proposed


def test_self_draft_accepts_everything_and_saves_steps(stories, stories_path, prompts, plain):
    engine = make_engine(stories, block_size=4, num_blocks=256, speculative="draft", num_speculative_tokens=4,
                         speculative_model=stories_path)
    outs = run(engine, prompts[:1], max_tokens=40)
    assert outs[0].outputs[0].token_ids == run(make_engine(stories), prompts[:1], max_tokens=40)[0].outputs[0].token_ids
    m = outs[0].metrics
    assert m.spec_acceptance_rate == 1.0 and m.mean_accepted_length > 3.8  # 4 a step, the last capped by max_tokens
    assert engine.num_steps < 40 / 3


def test_guessing_stops_when_the_batch_is_large(stories, prompts):
    engine = make_engine(stories, speculative="ngram", speculative_disable_batch_size=2)
    run(engine, prompts)  # four at once: past the threshold most of the time
    many = engine.num_spec_proposed
    engine = make_engine(stories, speculative="ngram", speculative_disable_batch_size=2)
    run(engine, prompts[:2])
    assert engine.num_spec_proposed > many


@pytest.mark.parametrize("options, message", [
    (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative="draft"), "speculative_model"),
    (dict(speculative="lookahead"), "speculative method"),
])
def test_bad_speculative_choices_are_refused(stories, options, message):
    with pytest.raises(ValueError, match=message):
        make_engine(stories, **options)


@pytest.mark.slow
def test_a_draft_with_another_vocabulary_is_refused(smollm2, stories_path):
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(smollm2, max_model_len=256, speculative="draft", speculative_model=stories_path)


# ---- speculative sampling keeps the target's distribution ----
def chi_square_p_value(observed, expected):
    """Pearson's test; bins with expected counts under 5 are merged into one. The chi-square
    survival function with d degrees of freedom is the regularized upper gamma Q(d/2, x/2)."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    keep = exp > 0
    stat = (((obs - exp) ** 2) / exp)[keep].sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


@pytest.mark.parametrize("proposer", ["draft", "point"])
def test_speculative_sampling_draws_from_the_target_distribution(stories, proposer):
    """The first emitted token of 40,000 verifications, each with fresh guesses drawn from a draft
    distribution q (or point guesses, as n-gram lookup makes), is distributed as the target's p.
    The test is deterministic (fixed seeds); the chance that a correct sampler fails it is the
    test's significance level, 1e-4."""
    engine = make_engine(stories)
    tok = stories.tokenizer
    ids = tok.encode("Once upon a time, there was a")
    with torch.no_grad():  # the target's logits after the context and after two guessed tokens
        engine.add_request("p", ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
        rows = []
        engine.on_prompt_logits.add(lambda rid, start, logits: rows.append(logits))
        while engine.has_unfinished():
            engine.step()
    p_rows = torch.cat(rows)[-1:].repeat(3, 1)  # one context; the later rows only matter after acceptance
    params = SamplingParams(temperature=0.8, top_k=30, max_tokens=8)
    from kvserve.runner.sampler import filter_logits
    p0 = filter_logits(p_rows[:1].clone(), [params]).softmax(-1)[0]
    g = torch.Generator().manual_seed(7)
    q = torch.softmax(torch.randn(2, p_rows.shape[1], generator=g) * 2, -1)  # a draft that disagrees
    counts = torch.zeros_like(p0)
    trials = 40_000
    sampler = Sampler(0)
    for t in range(trials):
        guesses = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        seq = ScheduledSequence(f"s{t}", [ids[-1]], len(ids) - 1, (), params, 1, ids, [], t, guesses,
                                q if proposer == "draft" else None)
        tokens, _ = sampler.verify(p_rows, seq)
        counts[tokens[0]] += 1
        sampler.forget([f"s{t}"])
    assert chi_square_p_value(counts, p0 * trials) > 1e-4
    assert math.isclose(counts.sum().item(), trials)


def test_a_request_whose_guesses_keep_failing_is_not_guessed_for_a_while(tiny_llama):
    """A repetitive prompt gives lookup plenty to propose; a random model does not follow it."""
    from kvserve.engine.llm_engine import SPEC_JUDGE_AFTER, SPEC_PAUSE_STEPS
    engine = make_engine(tiny_llama, speculative="ngram", num_speculative_tokens=4)
    plain = run(make_engine(tiny_llama), [[1, 2, 3, 4] * 6], max_tokens=60)[0].outputs[0].token_ids
    out = run(engine, [[1, 2, 3, 4] * 6], max_tokens=60)[0]
    assert out.outputs[0].token_ids == plain
    m = out.metrics
    assert m.spec_acceptance_rate < 0.25
    # guessing resumes after each pause, so at most one judged window per pause and steps between
    assert m.num_spec_proposed <= (60 // SPEC_PAUSE_STEPS + 1) * (SPEC_JUDGE_AFTER + 4)


# ---- a seeded request's samples depend only on its seed and their positions ----
SEEDED = SamplingParams(temperature=0.9, seed=1234, max_tokens=40, ignore_eos=True)


def run_sampled(engine, requests):
    """(prompt, params) pairs to completion -> each one's output tokens, in order."""
    ids = [engine.add_request(None, p, params) for p, params in requests]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def seeded_alone(stories, prompts):
    """The seeded request alone: no guesses, no preemption, nothing batched beside it."""
    return run_sampled(make_engine(stories, block_size=4, num_blocks=256), [(prompts[0], SEEDED)])[0]


def spec_options(method, stories_path):
    spec = dict(speculative=method, num_speculative_tokens=3)
    if method == "draft":
        spec["speculative_model"] = stories_path
    return spec


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_seeded_request_samples_as_alone_under_guesses_preemption_batching_and_prefix_hits(
        stories, stories_path, prompts, method, mode):
    """Found by the adversarial run (issue 32): with guesses and preemption, a seeded T=0.9
    request differed from its solo run 3 times in 3. Here it runs twice (the second a prefix
    hit) among sampled neighbours, unseeded and seeded otherwise, in a pool that forces
    preemption; both copies draw exactly the tokens of its solo run with the same guesser."""
    spec = spec_options(method, stories_path)
    alone = run_sampled(make_engine(stories, block_size=4, num_blocks=256, **spec), [(prompts[0], SEEDED)])[0]
    engine = make_engine(stories, block_size=4, num_blocks=36, max_num_batched_tokens=64, preemption_mode=mode, **spec)
    others = [SamplingParams(temperature=0.9, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=40, ignore_eos=True)]
    outs = run_sampled(engine, [(prompts[0], SEEDED)] + list(zip(prompts[1:], others)) + [(prompts[0], SEEDED)])
    assert engine.stats().scheduler.num_preemptions > 0 and engine.num_spec_accepted > 0
    assert outs[0] == alone and outs[-1] == alone


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_guesses_change_no_sampled_token(stories, stories_path, prompts, seeded_alone, method):
    """Every token is drawn from the target's distribution with the random numbers of its own
    position; guesses only decide how many positions one step settles, so a sampled request
    with guesses equals the same request without them."""
    engine = make_engine(stories, block_size=4, num_blocks=256, **spec_options(method, stories_path))
    assert run_sampled(engine, [(prompts[0], SEEDED)])[0] == seeded_alone
    assert engine.num_spec_accepted > 0


def test_a_self_draft_guesses_every_sampled_token(stories, stories_path, prompts):
    """The draft draws each guess with its target's key and position (seeded or not), so a draft
    that is the target itself guesses every sampled token. (The first request takes the
    target's first unseeded key and is never guessed for: the draft's own count would differ.)"""
    engine = make_engine(stories, block_size=4, num_blocks=256, **spec_options("draft", stories_path))
    unseeded = SamplingParams(temperature=0.9, max_tokens=40, ignore_eos=True)
    run_sampled(engine, [(prompts[2], SamplingParams(temperature=0.9, max_tokens=1)), (prompts[0], SEEDED),
                         (prompts[1], unseeded)])
    assert engine.num_spec_proposed > 40 and engine.num_spec_accepted == engine.num_spec_proposed
