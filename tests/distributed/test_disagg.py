"""Prefill/decode disaggregation: a prompt's K/V computed by one engine and handed to another
decodes to the colocated engine's tokens, the decode side computes no prompt token, neither
side leaks a block, and a handover from another model or KV format is refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.core.sampling_params import SamplingParams
from kvserve.distributed.disagg import DisaggregatedLLM, KVExporter, QueueConnector
from tests.conftest import greedy, make_engine, random_llama, run_collecting_logits

PROMPTS = ["Once upon a time, there was a little girl named Lily. She had a red ball and a big",
           "The dog ran to the park",
           "Tom and Sue were friends. They liked to play in the sand by the sea. One day, Tom",
           "Once upon a time, there was a little girl named Lily. She had a cat"]


def _colocated(loaded, prompts, params, **options):
    outputs, _ = run_collecting_logits(make_engine(loaded, **options), prompts, params)
    return [o.outputs[0].token_ids for o in outputs]


def _handed_over(loaded, prompts, params, prefill_options=None, **options):
    """Two engines in this process joined by a QueueConnector; returns tokens and both engines."""
    prefill = make_engine(loaded, **{**options, **(prefill_options or {})})
    decode = make_engine(loaded, **options)
    exporter, connector = KVExporter(prefill), QueueConnector()
    ids = [exporter.add(f"r{i}", p, params) for i, p in enumerate(prompts)]
    done = {}
    while len(done) < len(ids):
        if prefill.has_unfinished():
            prefill.step()
            prefill.check_integrity()
        for handover in exporter.take():
            connector.send(handover)
        while (handover := connector.poll()) is not None:
            decode.add_prefilled(handover, params)
        if decode.has_unfinished():
            for out in decode.step():
                if out.finished:
                    done[out.request_id] = out
            decode.check_integrity()
    return [done[i].outputs[0].token_ids for i in ids], prefill, decode


def _no_block_held(engine):
    s = engine.stats().scheduler
    assert s.num_running == s.num_waiting == 0
    assert s.num_free_blocks == s.num_blocks  # cached blocks are free (evictable); none is referenced


@pytest.mark.parametrize("options", [dict(), dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="bfloat16"),
                                     # a small decode pool: handed-over requests are preempted, recomputed
                                     dict(block_size=4, num_blocks=30, max_num_seqs=3, max_prefill_chunk=8)])
def test_handed_over_equals_colocated(stories, options):
    params = greedy(32)
    want = _colocated(stories, PROMPTS, params, **options)
    got, prefill, decode = _handed_over(stories, PROMPTS, params, **options)
    assert got == want
    assert decode.num_prompt_tokens_computed == 0 or options.get("num_blocks")  # recompute after preemption
    assert prefill.num_generated_tokens == len(PROMPTS)  # one token each, then handed over
    _no_block_held(prefill)
    _no_block_held(decode)


def test_seeded_sampling_continues_the_prefill_engines_draws(stories):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24)
    assert _handed_over(stories, PROMPTS, params)[0] == _colocated(stories, PROMPTS, params)


def test_a_request_ended_by_its_first_token_is_not_handed_any_block(stories):
    params = greedy(1)
    got, prefill, decode = _handed_over(stories, PROMPTS[:2], params)
    assert got == _colocated(stories, PROMPTS[:2], params) and all(len(t) == 1 for t in got)
    assert decode.num_steps <= 2 and decode.stats().scheduler.num_free_blocks == decode.stats().scheduler.num_blocks


@pytest.mark.parametrize("prefill_options,decode_options,message", [
    (dict(kv_cache_dtype="int8"), dict(), "kv_cache_dtype 'int8'"),
    (dict(block_size=8), dict(block_size=16), "block_size 8"),
])
def test_a_mismatched_handover_is_refused(stories, prefill_options, decode_options, message):
    prefill, decode = make_engine(stories, **prefill_options), make_engine(stories, **decode_options)
    exporter = KVExporter(prefill)
    exporter.add("r", PROMPTS[0], greedy(8))
    while prefill.has_unfinished():
        prefill.step()
    (handover,) = exporter.take()
    with pytest.raises(ValueError, match=message):
        decode.add_prefilled(handover, greedy(8))
    _no_block_held(decode)


def test_a_handover_from_another_model_is_refused(stories):
    other = random_llama(num_layers=5, vocab=512, hidden=64, heads=8, kv_heads=4)
    other = dataclasses.replace(other, config=dataclasses.replace(other.config, head_dim=8))
    prefill, decode = make_engine(other), make_engine(stories)
    exporter = KVExporter(prefill)
    exporter.add("r", [1, 2, 3, 4, 5], greedy(8))
    while prefill.has_unfinished():
        prefill.step()
    with pytest.raises(ValueError, match="model_id"):
        decode.add_prefilled(exporter.take()[0], greedy(8))


@pytest.mark.parametrize("options,message", [(dict(kv_cache_dtype="int4"), "int4"),
                                             (dict(sliding_window=32), "sliding")])
def test_caches_a_handover_cannot_carry_are_refused(stories, options, message):
    with pytest.raises(ValueError, match=message):
        KVExporter(make_engine(stories, **options))


def test_two_processes_over_torch_distributed(stories_path):
    """The prefill engine in its own process, K/V over gloo send/recv."""
    params = greedy(32)
    from kvserve.engine.llm import LLM
    want = [o.outputs[0].token_ids for o in LLM(stories_path).generate(PROMPTS, params)]
    llm = DisaggregatedLLM(stories_path)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        stats = llm.prefill_stats()
        assert got == want
        assert llm.engine.num_prompt_tokens_computed == 0
        assert stats["num_sent"] == len(PROMPTS) and stats["num_running"] == stats["num_waiting"] == 0
        assert stats["num_free_blocks"] == stats["num_blocks"]
        assert llm.connector.bytes_received == stats["bytes_sent"] > 0
        _no_block_held(llm.engine)
    finally:
        llm.close()
