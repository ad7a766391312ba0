"""Cached decoding equals recomputation: paged (block sizes 1, 16, 32) == contiguous == no
cache, token for token, with every step's logits within 1e-4 (fp32), for prompts that end on a
block boundary, one past it, and inside the first block."""

import pytest
import torch

from tests.conftest import compiled_kernel, greedy, make_engine, run_collecting_logits

TEXT = ("The cache keeps the keys and values of every token it has seen, so each new token "
        "costs a pass over the cache instead of a pass over the whole sequence again. ") * 4
LENGTHS = (5, 15, 16, 17, 32, 33)  # inside a block, boundary-1, boundary, boundary+1 (16 and 32)
LAYOUTS = [dict(kv_layout="paged", block_size=1, num_blocks=600),
           dict(kv_layout="paged", block_size=16, num_blocks=64),
           dict(kv_layout="paged", block_size=32, num_blocks=32),
           dict(kv_layout="contiguous", max_model_len=64, num_blocks=8)]


def prompts_for(tokenizer):
    ids = tokenizer.encode(TEXT)
    return [ids[:n] for n in LENGTHS]


def assert_same(ref, got):
    (ref_out, ref_logits), (out, logits) = ref, got
    for r, o in zip(ref_out, out):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    for rid_ref, rid in zip(ref_logits, logits):
        a, b = torch.stack(ref_logits[rid_ref]), torch.stack(logits[rid])
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def stories_reference(stories):
    engine = make_engine(stories, use_cache=False, max_model_len=64)
    return run_collecting_logits(engine, prompts_for(stories.tokenizer), greedy(12, ignore_eos=True))


@pytest.mark.parametrize("backend", ["torch", "cpu-kernel"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: f"{d['kv_layout']}-{d.get('block_size', 'slab')}")
def test_stories_cached_equals_recompute(stories, stories_reference, layout, backend):
    if backend == "cpu-kernel":
        compiled_kernel("paged_attention")  # skips where compiled kernels are off or cannot build
    engine = make_engine(stories, **{"max_model_len": 64, "attention_backend": backend, **layout})
    got = run_collecting_logits(engine, prompts_for(stories.tokenizer), greedy(12, ignore_eos=True))
    assert_same(stories_reference, got)
    assert engine.kv.pool.num_free_blocks == engine.plan.num_blocks


@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    engine = make_engine(smollm2, use_cache=False, max_model_len=64, exact=True)
    return run_collecting_logits(engine, prompts_for(smollm2.tokenizer), greedy(6, ignore_eos=True))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: f"{d['kv_layout']}-{d.get('block_size', 'slab')}")
def test_smollm2_cached_equals_recompute(smollm2, smollm2_reference, layout):
    engine = make_engine(smollm2, **{"max_model_len": 64, "exact": True, **layout})
    got = run_collecting_logits(engine, prompts_for(smollm2.tokenizer), greedy(6, ignore_eos=True))
    assert_same(smollm2_reference, got)


def test_solo_equals_batched_and_chunked(stories):
    prompts = prompts_for(stories.tokenizer)
    solo = [run_collecting_logits(make_engine(stories, max_model_len=64), [p], greedy(12, ignore_eos=True))
            for p in prompts]
    chunked = make_engine(stories, max_model_len=64, max_num_batched_tokens=7, max_prefill_chunk=5)
    outs, logits = run_collecting_logits(chunked, prompts, greedy(12, ignore_eos=True))
    for (s_out, s_logits), out, rid in zip(solo, outs, logits):
        assert out.outputs[0].token_ids == s_out[0].outputs[0].token_ids
        a, b = torch.stack(next(iter(s_logits.values()))), torch.stack(logits[rid])
        assert (a - b).abs().max().item() < 1e-4
