import pytest
import torch

from kvserve.core.outputs import ScheduledSequence
from kvserve.runner.sampler import Sampler, TokenHistory, apply_penalties, draw_seed, filter_logits
from kvserve.core.sampling_params import SamplingParams
from tests.conftest import make_llm


def seq(rid, params, n=1, prompt=(), output=(), spec=()):
    return ScheduledSequence(rid, [1], 0, (), params, n, list(prompt), list(output), params.seed, list(spec))


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=1.2),
    dict(max_tokens=0), dict(max_tokens=-3), dict(n=0), dict(repetition_penalty=0.0),
    dict(presence_penalty=3.0), dict(frequency_penalty=-2.5), dict(stop=[""]), dict(seed="x"),
    dict(logprobs=50), dict(min_tokens=20, max_tokens=5), dict(temperature=float("nan")),
])
def test_invalid_parameters_raise_naming_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_top_k_top_p_min_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def keep(p):
        return torch.isfinite(filter_logits(logits.clone(), [p]))[0].tolist()
    assert keep(SamplingParams(top_k=2)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.8)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.81)) == [True, True, True, False]
    assert keep(SamplingParams(top_p=0.1)) == [True, False, False, False]
    assert keep(SamplingParams(min_p=0.5)) == [True, True, False, False]


def history(prompt, output, vocab=4):
    h = TokenHistory(vocab, prompt, torch.device("cpu"))
    h.catch_up(output)
    return h


def test_penalties():
    row = torch.tensor([2.0, -2.0, 1.0, 0.0])
    out = apply_penalties(row.clone(), SamplingParams(repetition_penalty=2.0), history([0], [1]))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.0]
    out = apply_penalties(row.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=1.0),
                          history([], [2, 2]))
    assert out.tolist() == [2.0, -2.0, -1.5, 0.0]


def test_token_history_grows_in_place_and_copies_with_proposals():
    h = history([3], [1])
    h.catch_up([1, 2, 2])  # two new tokens since the last step
    assert h.counts.tolist() == [0, 1, 2, 0] and h.seen.tolist() == [False, True, True, True]
    more = h.with_tokens([0, 2])
    assert more.counts.tolist() == [1, 1, 3, 0] and h.counts.tolist() == [0, 1, 2, 0]


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.17e-38, min_p=0.8), SamplingParams(repetition_penalty=8e-305, top_k=3),
    SamplingParams(temperature=1e-30, top_p=0.5), SamplingParams(temperature=1e-45),
    SamplingParams(temperature=0, repetition_penalty=1e-38),
], ids=["tiny-penalty-min-p", "underflowing-penalty", "tiny-temperature", "denormal-temperature", "greedy"])
def test_extreme_but_valid_parameters_still_sample_the_favourite(params):
    """Values that overflow fp32 (found by the API fuzzer) pick among the top tokens, never crash."""
    logits = torch.tensor([[3.0, 5.0, -1.0, 0.5, 4.0]])
    tokens, _ = Sampler(0)(logits, [seq("a", params, n=8, prompt=[1, 4])])
    assert set(tokens[0]) <= {1, 4}


def test_fixed_seed_reproduces_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=42)
    a, _ = Sampler(0)(logits, [seq("a", p, n=4), seq("b", SamplingParams(temperature=0)), seq("c", p)])
    b, _ = Sampler(1)(logits[:1], [seq("zz", p, n=4)])
    assert a[0] == b[0]
    assert a[1] == [int(logits[1].argmax())]
    c, _ = Sampler(0)(logits[:1], [seq("a", SamplingParams(temperature=0.9, top_p=0.9, seed=43), n=4)])
    d, _ = Sampler(0)(logits[:1], [seq("a", SamplingParams(temperature=0.9, top_p=0.9, seed=44), n=4)])
    assert len({tuple(a[0]), tuple(c[0]), tuple(d[0])}) > 1


def test_a_seeded_draw_depends_only_on_the_seed_and_the_position():
    """Whatever was drawn before (other positions, guesses checked and rejected, a step drawn
    again after preemption), a seeded request's token at an output position is the same."""
    torch.manual_seed(0)
    rows = torch.randn(3, 50)
    p = SamplingParams(temperature=0.9, seed=42)

    def at(sampler, position, row):
        return sampler(rows[row:row + 1], [seq("a", p, output=[7] * position)])[0][0][0]
    fresh = [at(Sampler(0), position, position) for position in range(3)]
    busy = Sampler(1)
    busy.verify(rows, seq("a", p, output=[7], spec=[(fresh[1] + 1) % 50, 3]))  # a rejected guess
    at(busy, 2, 2)
    at(busy, 0, 0)
    assert [at(busy, position, position) for position in (2, 1, 0)] == fresh[::-1]
    # golden: changing the derivation changes every seeded request's tokens
    assert (draw_seed(42, 0), draw_seed(42, 1), draw_seed(-1, 0) == draw_seed(2**64 - 1, 0)) == (
        10996452266160306281, 2958219263312191191, True)


def test_verifying_guesses_emits_the_tokens_plain_sampling_draws():
    """A guess is accepted exactly when it is the token the position draws; the first that is
    not is replaced by that token, so guesses change how many positions a step settles, never
    which tokens."""
    torch.manual_seed(1)
    rows = torch.randn(3, 50)
    p = SamplingParams(temperature=0.9, seed=7)
    plain = [Sampler(0)(rows[i:i + 1], [seq("a", p, output=[1] * (2 + i))])[0][0][0] for i in range(3)]
    good = Sampler(0).verify(rows, seq("a", p, output=[1, 1], spec=plain[:2]))[0]
    bad = Sampler(0).verify(rows, seq("a", p, output=[1, 1], spec=[plain[0], (plain[1] + 1) % 50]))[0]
    assert good == plain and bad == plain[:2]


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    tokens, lps = Sampler(0)(logits, [seq("a", SamplingParams(temperature=0, logprobs=2))])
    ref = logits[0].log_softmax(-1)
    assert tokens == [[2]] and lps[0][0] == pytest.approx({2: float(ref[2]), 1: float(ref[1])})


def test_seeded_generation_reproduces_end_to_end(stories):
    llm = make_llm(stories)
    p = SamplingParams(temperature=1.0, top_k=20, seed=123, max_tokens=30)
    a = llm.generate(["Once upon a time"], p)[0].outputs[0].token_ids
    b = llm.generate(["Once upon a time", "Tom"], p)[0].outputs[0].token_ids
    c = llm.generate(["Once upon a time"], SamplingParams(temperature=1.0, top_k=20, seed=124, max_tokens=30))
    assert a == b and a != c[0].outputs[0].token_ids


def test_stop_strings_truncate_and_finish(stories):
    llm = make_llm(stories)
    full = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].text
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30, stop=["Lily"]))[0]
    c = out.outputs[0]
    assert c.text == full[:full.index("Lily")] and c.finish_reason == "stop" and c.stop_reason == "Lily"
    assert llm.engine.kv.pool.num_used_blocks == 0
    streamed = "".join(o.outputs[0].delta for o in llm.stream("Once upon a time",
                                                               SamplingParams(temperature=0, max_tokens=30, stop=["Lily"])))
    assert streamed == c.text


@pytest.mark.parametrize("temperature", [0.0, 3.8e-199, 1e-300, 9e-6])
def test_a_temperature_that_underflows_is_greedy(temperature):
    """Found by the API fuzzer: 3.8e-199 becomes 0 in fp32, and dividing by it made NaN."""
    params = SamplingParams(temperature=temperature, n=4, min_p=0.8, repetition_penalty=9.97, logprobs=6)
    logits = torch.tensor([[3.0, 5.0, -1.0, 0.5, 4.0]])
    tokens, _ = Sampler(0)(logits, [seq("a", params, n=4, prompt=[1, 4])])
    assert tokens == [[Sampler(0)(logits, [seq("b", SamplingParams(temperature=0, repetition_penalty=9.97),
                                              prompt=[1, 4])])[0][0][0]] * 4]


def test_greedy_argmax_equals_torchs_on_every_path(monkeypatch):
    """argmax_rows (the compiled kernel where the build has it) and torch's max(-1) give the same
    ids: random rows, ties, NaN, a non-contiguous batch; with the kernel turned off too."""
    from kvserve.runner import sampler
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 1000, generator=g)
    x[1] = 2.0
    x[2, 500] = float("nan")
    for rows in (x, x[::2], torch.randn(3, 1000, 2, generator=g)[..., 0], x.double()):
        assert torch.equal(sampler.argmax_rows(rows), rows.max(-1).indices)
    expected = x.max(-1).indices
    monkeypatch.setattr(sampler, "compiled_argmax", lambda: None)
    assert torch.equal(sampler.argmax_rows(x), expected)
