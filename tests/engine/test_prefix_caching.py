"""Prefix caching: identical outputs on and off, shared prefixes reported and not recomputed,
isolation by salt, dtype and model, and forks whose writes never reach the parent."""

import pytest

from kvserve.core.sampling_params import SamplingParams
from tests.conftest import greedy, make_engine, make_llm


def long_prompt(tok, n, tail):
    base = tok.encode("Once upon a time, there was a little girl named Lily who liked to play. " * 60)
    return base[:n] + tok.encode(tail, add_special_tokens=False)


def test_prefix_caching_on_and_off_give_identical_outputs(stories):
    tok = stories.tokenizer
    prompts = [long_prompt(tok, 200, t) for t in (" She", " Then Tom", " The dog")] * 2
    on = make_llm(stories, num_blocks=128).generate(prompts, greedy(16))
    off = make_llm(stories, num_blocks=128, enable_prefix_caching=False).generate(prompts, greedy(16))
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert sum(o.num_cached_tokens for o in on) > 0 and sum(o.num_cached_tokens for o in off) == 0


@pytest.mark.slow
def test_thousand_token_shared_prefix_is_computed_once(smollm2):
    tok = smollm2.tokenizer
    engine = make_engine(smollm2, num_blocks=160, max_model_len=2048, exact=True)
    shared = tok.encode("The paged cache shares full blocks between requests with one prefix. " * 90)[:1000]
    prompts = {"a": shared + tok.encode(" Summarize."), "b": shared + tok.encode(" Translate it.")}
    outs, computed = {}, {}
    for name, prompt in prompts.items():
        before = engine.num_prompt_tokens_computed
        engine.add_request(name, prompt, greedy(2))
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] = o
        computed[name] = engine.num_prompt_tokens_computed - before
    assert outs["a"].num_cached_tokens == 0 and computed["a"] == len(prompts["a"])
    assert outs["b"].num_cached_tokens >= 992
    assert computed["b"] == len(prompts["b"]) - outs["b"].num_cached_tokens
    assert engine.stats().scheduler.prefix_hit_rate > 0.45


def test_cache_salt_isolates_tenants(stories):
    tok = stories.tokenizer
    engine = make_engine(stories, num_blocks=128)
    prompt = long_prompt(tok, 100, "")
    results = {}
    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1"), ("d", None)):
        engine.add_request(rid, prompt, greedy(2), cache_salt=salt)
        while engine.has_unfinished():
            for o in engine.step():
                results[o.request_id] = o
    assert results["a"].num_cached_tokens == 0
    assert results["b"].num_cached_tokens == 0  # a different salt never shares a block
    assert results["c"].num_cached_tokens == 96
    assert results["d"].num_cached_tokens == 0


def test_other_kv_dtype_or_model_never_hits(stories):
    a = make_engine(stories, num_blocks=64)
    b = make_engine(stories, num_blocks=64, kv_cache_dtype="bfloat16")
    assert a.kv.namespace != b.kv.namespace
    prompt = long_prompt(stories.tokenizer, 64, "")
    a.add_request("x", prompt, greedy(1))
    while a.has_unfinished():
        a.step()
    b.kv.pool = a.kv.pool  # the same blocks, seen from another namespace: lookups miss
    from kvserve.core.request import Request
    assert b.kv.find_cached_prefix(Request("p", prompt, greedy(1)))[1] == 0
    assert a.kv.find_cached_prefix(Request("q", prompt, greedy(1)))[1] == 48
    other_model = make_engine(stories, num_blocks=64)
    other_model.kv.namespace = ("another-model",) + a.kv.namespace[1:]
    other_model.kv.pool = a.kv.pool
    assert other_model.kv.find_cached_prefix(Request("r", prompt, greedy(1)))[1] == 0


def test_fork_copy_on_write_leaves_the_parent_unchanged(stories):
    tok = stories.tokenizer
    prompt = tok.encode("Once upon a time, there was a little")  # ends inside a block
    solo = make_llm(stories, block_size=16).generate([prompt], greedy(24))[0].outputs[0].token_ids
    llm = make_llm(stories, block_size=16)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=24)
    out = llm.generate([prompt], params)[0]
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    # greedy n=3: children sample the same tokens, and every copy equals the solo run
    g = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=24))[0]
    assert all(c.token_ids == solo for c in g.outputs)
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.plan.num_blocks


@pytest.mark.slow
def test_smollm2_prefix_caching_on_off_identical(smollm2):
    tok = smollm2.tokenizer
    system = tok.encode("You are a careful assistant. Answer briefly and precisely. " * 6)
    prompts = [system + tok.encode(q) for q in (" What is 2+2?", " Name a color.")]
    # exact: a cached prefix changes how many rows a product multiplies, and so the defaults' path
    on = make_llm(smollm2, num_blocks=64, exact=True).generate(prompts * 2, greedy(6))
    off = make_llm(smollm2, num_blocks=64, enable_prefix_caching=False, exact=True).generate(prompts * 2, greedy(6))
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert on[2].num_cached_tokens >= 64
