"""Every KV cache format keeps the engine's promises: prefix caching on == off, swap preemption
== none, batched and chunked == solo, n > 1 forks sharing blocks, nothing leaked; and bad
choices are refused clearly."""

import pytest
import torch

from tests.conftest import greedy, make_engine, run_collecting_logits

FORMATS = ["bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
SHARED = "Once upon a time there was a little girl named Lily who loved to play in the big park with her"
ENDINGS = [" dog", " friends Tom and Sue", " mom", " ball and her red kite every day after school", "", " cat"]


def prompts(tok):
    return [tok.encode(SHARED + e) for e in ENDINGS]


def run(engine, ps, n=20):
    outs, logits = run_collecting_logits(engine, ps, greedy(n, ignore_eos=True))
    assert engine.kv.pool.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outs], [torch.stack(v) for v in logits.values()]


def assert_same(a, b):
    """The same tokens, and logits as close as the format allows. Computing the same K/V in
    another batch shape can differ in its last fp32 bit; a lossless cache keeps that at 1e-5,
    but a value that sits on a rounding boundary of a lossy format moves a whole step (measured
    here: up to 0.14 on stories260K's logits, with every token the same)."""
    assert a[0] == b[0]
    diff = max((x - y).abs().max().item() for x, y in zip(a[1], b[1]))
    assert diff < 0.3, diff


@pytest.fixture(scope="module", params=FORMATS)
def solo(request, stories):
    fmt = request.param
    ps = prompts(stories.tokenizer)
    outs = [run(make_engine(stories, kv_cache_dtype=fmt, block_size=4, num_blocks=128), [p]) for p in ps]
    return fmt, ps, ([o[0][0] for o in outs], [o[1][0] for o in outs])


def test_batched_and_chunked_equal_solo(stories, solo):
    fmt, ps, expected = solo
    engine = make_engine(stories, kv_cache_dtype=fmt, block_size=4, num_blocks=128, max_num_batched_tokens=16,
                         max_prefill_chunk=7, enable_prefix_caching=False)
    assert_same(run(engine, ps), expected)


def test_prefix_caching_on_equals_off(stories, solo):
    fmt, ps, expected = solo
    engine = make_engine(stories, kv_cache_dtype=fmt, block_size=4, num_blocks=128)
    got = run(engine, ps)
    assert_same(got, expected)
    assert engine.stats().scheduler.prefix_hit_rate > 0.5  # the shared prompt really was shared


def test_swap_preemption_equals_none(stories, solo):
    fmt, ps, expected = solo
    engine = make_engine(stories, kv_cache_dtype=fmt, block_size=4, num_blocks=30, preemption_mode="swap",
                         swap_space=1 << 24, enable_prefix_caching=False)
    got = run(engine, ps)
    assert engine.stats().scheduler.num_preemptions > 0
    assert_same(got, expected)


def test_forks_share_blocks_and_copy_on_write(stories, solo):
    fmt, ps, expected = solo
    engine = make_engine(stories, kv_cache_dtype=fmt, block_size=4, num_blocks=128)
    engine.add_request("r", ps[0], greedy(20, ignore_eos=True, n=3))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert [c.token_ids for c in out.outputs] == [expected[0][0]] * 3
        engine.scheduler.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0


def test_formats_cost_what_the_formula_says(stories):
    from kvserve.kv.formats import kv_format
    for fmt in FORMATS + ["float32"]:
        engine = make_engine(stories, kv_cache_dtype=fmt, block_size=4, num_blocks=16)
        per_token = kv_format(fmt).bytes_per_token(stories.config, 4)
        assert engine.plan.block_bytes == engine.storage.bytes_per_block == per_token * 4
        assert engine.storage.nbytes == engine.plan.total_bytes - engine.plan.fixed_bytes


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache_dtype="int3"), "unknown kv cache dtype 'int3'"),
    (dict(kv_cache_dtype="int4", kv_layout="contiguous"), "contiguous"),
    (dict(kv_cache_dtype="int8", kv_cache_scales="s.json"), "fp8"),
    (dict(kv_cache_dtype="int8", device="cuda"), "CUDA"),
    (dict(use_cache=False, attention_backend="cpu-kernel"), "paged cache"),
])
def test_bad_choices_are_refused_naming_the_problem(stories, options, message):
    with pytest.raises(ValueError, match=message):
        make_engine(stories, **options)


def test_int4_needs_an_even_head_dim(tiny_llama):
    from kvserve.config import ModelConfig
    from kvserve.kv.formats import check_format, kv_format
    odd = ModelConfig(vocab_size=16, hidden_size=18, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # head_dim 9
    with pytest.raises(ValueError, match="head_dim is 9"):
        check_format(kv_format("int4"), odd, 16)


def test_fp8_scales_from_a_file(stories, tmp_path):
    import json
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k": 0.05, "v": [[0.02] * 4] * 5}))
    engine = make_engine(stories, kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(path))
    assert engine.storage.scales[:, 0].eq(0.05).all() and engine.storage.scales[:, 1].eq(0.02).all()
    path.write_text(json.dumps({"k": -1, "v": 1}))
    with pytest.raises(ValueError, match="positive"):
        make_engine(stories, kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(path))
    path.write_text(json.dumps({"k": [[1, 2]], "v": 1}))
    with pytest.raises(ValueError, match="5 layers and 4 KV heads"):
        make_engine(stories, kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(path))
