"""The decode step's short paths give what the general ones give: a plain greedy batch's argmax
(greedy_tokens) equals the general sampler's choice, ties and -inf included; a step of single-token
decodes prepared from Python lists (_prepare_decodes) equals the tensor-op path field for field as
the batch grows and shrinks and blocks are added; and whole runs through the short paths give the
tokens and logits of runs held to the general ones, bit for bit."""

import pytest
import torch

from kvserve.core.outputs import ScheduledSequence
from kvserve.core.sampling_params import SamplingParams
from kvserve.runner.sampler import Sampler, greedy_tokens, is_plain_greedy
from tests.conftest import assert_same_outputs, greedy, make_engine, run_collecting_logits

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"


def seq(rid, params, n=1):
    return ScheduledSequence(rid, [1], 5, (), params, n, [1, 2], [], params.seed, [])


def tricky_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random rows with tied maxima, -inf entries and a row that is -inf but for one token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (rows, vocab), generator=g).float()  # few values: many ties
    logits[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")
    logits[0] = float("-inf")
    logits[0, vocab - 1] = 0.5
    if rows > 1:
        logits[1, : vocab // 2] = 3.0  # the maximum tied over half the row
    return logits


@pytest.mark.parametrize("rows,vocab,seed", [(1, 97, 0), (3, 97, 1), (16, 97, 2), (64, 97, 3), (64, 49_152, 4)])
def test_greedy_tokens_equal_the_general_sampler(rows, vocab, seed):
    """(a real vocabulary's width takes torch's vectorized, threaded reductions)"""
    logits = tricky_logits(rows, vocab, seed)
    seqs = [seq(f"r{i}", SamplingParams(temperature=0.0), n=1 + i % 3) for i in range(rows)]
    general, logprobs = Sampler(0).general(logits.clone(), seqs)
    assert greedy_tokens(logits, seqs) == general
    fast, none = Sampler(0)(logits.clone(), seqs)
    assert fast == general and none == [None] * rows and logprobs == [None] * rows
    assert all(toks == [int(torch.argmax(row))] * s.num_samples for toks, row, s in zip(fast, logits, seqs))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, logit_bias={5: 100.0}), SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, seed=3),
])
def test_a_row_that_is_not_plain_greedy_takes_the_general_path(params):
    assert not is_plain_greedy(params)
    logits = tricky_logits(4, 97, 7)
    seqs = [seq("a", SamplingParams(temperature=0.0)), seq("b", params), seq("c", SamplingParams(temperature=0.0)),
            seq("d", SamplingParams(temperature=0.0))]
    assert Sampler(0)(logits.clone(), seqs) == Sampler(0).general(logits.clone(), seqs)
    if params.logit_bias:  # the bias wins: the short path would have missed it
        assert Sampler(0)(logits.clone(), seqs)[0][1] == [5]


def assert_same_input(fast, general):
    assert torch.equal(fast.input_ids, general.input_ids) and torch.equal(fast.positions, general.positions)
    assert [s.request_id for s in fast.seqs] == [s.request_id for s in general.seqs]
    assert fast.row_ends == general.row_ends
    for a, b in zip(fast.common, general.common, strict=True):
        for name in ("slot_mapping", "decode_block_tables", "decode_context_lens"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        for name in ("num_decode_tokens", "decode_max_context", "sliding_window", "prefills", "sinks", "kv_write_plan"):
            assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("options", [dict(), dict(sliding_window=20), dict(kv_cache_dtype="int4"),
                                     dict(block_size=4)], ids=["full", "window", "int4-cache", "block-4"])
def test_decode_inputs_equal_the_general_path_as_the_batch_changes(stories, options):
    """Prompts of different lengths and output budgets: the batch grows as requests are admitted
    and shrinks as they finish; every plain decode step is prepared both ways and compared."""
    engine = make_engine(stories, max_num_seqs=4, max_num_batched_tokens=32, **options)
    runner, compared = engine.runner, []
    general_prepare = runner._prepare_mixed

    def prepare(seqs):
        fast = type(runner).prepare(runner, seqs)
        if runner._is_plain_decode_step(seqs):
            assert_same_input(fast, general_prepare(seqs))
            compared.append(len(seqs))
        return fast
    runner.prepare = prepare
    ids = stories.tokenizer.encode(PROMPT)
    for i, n in enumerate((3, 9, 17, 24, 6)):
        engine.add_request(None, ids[:n], greedy(6 + 9 * i, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert {1, 4} <= set(compared)  # full batches and a lone request both went through


class GeneralSampler(Sampler):
    def __call__(self, logits, seqs):
        return self.general(logits, seqs)


def test_short_paths_give_the_general_paths_tokens_and_logits(stories):
    """Runs through the short paths (decode inputs from lists, sampling every row, greedy
    argmax) against runs held to the general ones: the same tokens and logits, bit for bit."""
    ids = stories.tokenizer.encode(PROMPT)
    prompts = [ids[:n] for n in (3, 9, 17, 24, 6)]
    runs = []
    for short in (True, False):
        engine = make_engine(stories, max_num_seqs=4, max_num_batched_tokens=32, weight_dtype="int8")
        if not short:
            runner = engine.runner
            runner._is_plain_decode_step = lambda seqs: False
            runner._samples_every_row = lambda hidden, inp: False
            runner.sampler.__class__ = GeneralSampler
        runs.append(run_collecting_logits(engine, prompts, greedy(20, ignore_eos=True)))
    assert_same_outputs(*runs)
