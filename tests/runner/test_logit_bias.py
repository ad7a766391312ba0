"""logit_bias in the sampler: +100 forces a token, -100 bans one, greedy and sampled, in plain
steps and in speculative verification (whose output stays plain decoding's); exactly the top k
logprobs come back, then the sampled token. (Bias with structured outputs:
tests/server/test_chat_sampling.py.)"""

import pytest
import torch

from kvserve.core.outputs import ScheduledSequence
from kvserve.core.sampling_params import SamplingParams
from kvserve.runner.sampler import Sampler, _logprobs
from tests.conftest import greedy, make_engine

VOCAB = 8


def seq(rid, params, output=(), spec=()):
    return ScheduledSequence(rid, [1], 0, (), params, 1, [1], list(output), params.seed, list(spec))


def logits(rows=1):
    return torch.log(torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.05, 0.03, 0.01, 0.01]] * rows))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plus_100_forces_and_minus_100_bans(temperature):
    s = Sampler(0)
    forced = SamplingParams(temperature=temperature, seed=3, logit_bias={6: 100})
    banned = SamplingParams(temperature=temperature, seed=3, logit_bias={0: -100, 1: -100})
    plain = SamplingParams(temperature=temperature, seed=3)
    for step in range(20):
        tokens, _ = s(logits(3), [seq(f"f{step}", forced), seq(f"b{step}", banned), seq(f"p{step}", plain)])
        assert tokens[0] == [6]
        assert tokens[1][0] not in (0, 1)
    assert s(logits(), [seq("g", SamplingParams(temperature=0))])[0] == [[0]]


def test_bias_leaves_the_logits_it_was_given_and_the_logprobs_raw():
    s, row = Sampler(0), logits()
    before = row.clone()
    tokens, lps = s(row, [seq("a", SamplingParams(temperature=0, logprobs=2, logit_bias={5: 100}))])
    assert tokens == [[5]] and torch.equal(row, before)
    # the top 2 of the model's own distribution, most likely first, then the sampled token
    assert list(lps[0][0]) == [0, 1, 5]
    assert lps[0][0][5] == pytest.approx(float(before.log_softmax(-1)[0, 5]))


def test_exactly_k_then_the_sampled_token():
    row = logits()[0]
    assert list(_logprobs(row, [1], 3)[0]) == [0, 1, 2]  # sampled among the top 3: 3 entries
    assert list(_logprobs(row, [7], 3)[0]) == [0, 1, 2, 7]  # not among them: it comes last
    assert list(_logprobs(row, [4], 0)[0]) == [4]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verification_applies_the_bias_as_a_plain_step(temperature):
    """verify() settles each position as a plain step would: a proposal the bias bans is rejected
    and the correction is the forced token."""
    params = SamplingParams(temperature=temperature, seed=9, logit_bias={3: 100})
    tokens, _ = Sampler(0).verify(logits(4), seq("v", params, spec=[3, 3, 0]))
    assert tokens == [3, 3, 3]  # two accepted, the third (0) corrected to the forced 3
    banned = SamplingParams(temperature=temperature, seed=9, logit_bias={0: -100})
    tokens, _ = Sampler(0).verify(logits(3), seq("w", banned, spec=[0, 0]))
    assert len(tokens) == 1 and tokens[0] != 0


@pytest.mark.parametrize("bad", [{-1: 5.0}, {3: 100.5}, {3: -101}, {3: float("nan")}, {"3": 1.0}, [(1, 2, 3)]])
def test_bad_logit_bias_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bad)


def test_beam_search_refuses_logit_bias():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(use_beam_search=True, temperature=0, n=2, logit_bias={1: 5})


def test_an_id_past_the_vocabulary_is_refused_by_the_engine(stories):
    engine = make_engine(stories)
    with pytest.raises(ValueError, match="logit_bias.*vocabulary"):
        engine.add_request(None, "Once", greedy(4, logit_bias={10 ** 6: 1.0}))


def _run(engine, prompt, params):
    engine.add_request("r", prompt, params)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    assert engine.kv.pool.num_used_blocks == 0
    return out.outputs[0].token_ids


SPEC_PROMPT = "Once upon a time, Lily and Tom went to the park. Once upon a time, Lily"


@pytest.fixture(scope="module")
def biased_plain(stories):
    """A bias that bans two of plain greedy's tokens, and the greedy tokens under it."""
    banned = _run(make_engine(stories), SPEC_PROMPT, greedy(16, ignore_eos=True))[:4]
    params = greedy(16, ignore_eos=True, logit_bias={banned[1]: -100, banned[3]: -100, 3: 2.5})
    plain = _run(make_engine(stories), SPEC_PROMPT, params)
    assert banned[1] not in plain and banned[3] not in plain
    return params, plain


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_with_a_bias_equals_plain_decoding(stories, stories_path, biased_plain, method):
    params, plain = biased_plain
    spec = {"speculative_model": stories_path} if method == "draft" else {}
    engine = make_engine(stories, speculative=method, num_speculative_tokens=3, **spec)
    assert _run(engine, SPEC_PROMPT, params) == plain
    assert engine.num_spec_proposed > 0
