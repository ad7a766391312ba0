"""Tensor parallelism: the shards put back together are the model, and an engine split over N
processes (gloo, one thread per rank) gives TP = 1's greedy tokens and logits within 1e-4,
through batching, chunked prefill, prefix caching and preemption (recompute and swap)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from kvserve.distributed.tensor_parallel import kv_heads_of, shard_config, shard_weights
from kvserve.models.packed import PackedWeight, quantize, FORMATS
from tests.conftest import greedy, make_engine, random_llama, run_collecting_logits

LOGIT_TOL = 1e-4
# shared prefixes (prefix hits), lengths from 3 to 40 tokens, more prompts than seats
STORY_PROMPTS = ["Once upon a time, there was a little girl named Lily.",
                 "Once upon a time, there was a little girl named Lily. She had a red ball",
                 "The dog ran to the park",
                 "Tom and Sue were friends. They liked to play in the sand by the sea. One day,",
                 "Once upon a time, there was a big bear",
                 "A cat"]
# a small pool of small blocks: requests are preempted and come back
PRESSURE = dict(block_size=4, num_blocks=40, max_num_seqs=4, max_prefill_chunk=8, max_num_batched_tokens=24)


def _max_diff(a: dict, b: dict) -> float:
    return max((x - y).abs().max().item() for ra, rb in zip(a, b) for x, y in zip(a[ra], b[rb]))


def _compare(loaded, prompts, tp: int, max_tokens: int = 24, ignore_eos: bool = False, logit_tol: float = LOGIT_TOL,
             **options):
    params = greedy(max_tokens, ignore_eos=ignore_eos)
    single = make_engine(loaded, **options)
    want, want_logits = run_collecting_logits(single, prompts, params)
    split = make_engine(loaded, tensor_parallel_size=tp, **options)
    try:
        got, got_logits = run_collecting_logits(split, prompts, params)
        stats = split.stats().scheduler
        comm = split.comm.num_all_reduces
    finally:
        split.close()
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    worst = _max_diff(want_logits, got_logits)
    assert worst < logit_tol, f"logits differ by {worst:.2e}"
    assert comm > 0
    return stats


# ---- the shards ----
def test_shards_put_together_are_the_model():
    loaded = random_llama(num_layers=2, hidden=64, heads=4, kv_heads=2)
    shards = [shard_weights(loaded, r, 2) for r in range(2)]
    sd = loaded.state_dict
    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"model.layers.1.self_attn.{name}.weight"
        assert torch.equal(torch.cat([s.state_dict[key] for s in shards]), sd[key])
    key = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([s.state_dict[key] for s in shards], dim=1), sd[key])
    key = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([s.state_dict[key] for s in shards], dim=1), sd[key])
    assert torch.equal(shards[1].state_dict["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    c = shards[0].config
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.head_dim) == (2, 1, 64, 16)


def test_packed_shards_keep_their_blocks():
    w = torch.randn(96, 128)
    p = quantize(w, FORMATS["q4_1"])
    loaded = random_llama(num_layers=1, hidden=128, heads=4, kv_heads=4)
    sd = dict(loaded.state_dict)
    sd["model.layers.0.self_attn.o_proj.weight"] = quantize(torch.randn(128, 128), FORMATS["q4_1"])
    sd["model.layers.0.self_attn.q_proj.weight"] = quantize(torch.randn(128, 128), FORMATS["q8_0"])
    loaded = dataclasses.replace(loaded, state_dict=sd)
    parts = [shard_weights(loaded, r, 2).state_dict for r in range(2)]
    o = [pt["model.layers.0.self_attn.o_proj.weight"] for pt in parts]
    q = [pt["model.layers.0.self_attn.q_proj.weight"] for pt in parts]
    assert all(isinstance(x, PackedWeight) for x in o + q)
    whole_o = sd["model.layers.0.self_attn.o_proj.weight"].dequantize()
    assert torch.equal(torch.cat([x.dequantize() for x in o], dim=1), whole_o)
    whole_q = sd["model.layers.0.self_attn.q_proj.weight"].dequantize()
    assert torch.equal(torch.cat([x.dequantize() for x in q]), whole_q)
    assert p.shape == (96, 128)


def test_fewer_kv_heads_than_ranks_are_replicated():
    c = random_llama(heads=8, kv_heads=2).config
    assert [list(kv_heads_of(c, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    # each rank's query heads read the KV head it holds: head h reads h // (8 / 2)
    for r in range(4):
        heads = range(r * 2, r * 2 + 2)
        assert {h // 4 for h in heads} == set(kv_heads_of(c, r, 4))
    assert shard_config(c, 4).num_key_value_heads == 1


@pytest.mark.parametrize("heads,kv_heads,tp,message", [(9, 3, 2, "attention heads"), (12, 4, 3, "KV heads"),
                                                        (6, 6, 4, "attention heads")])
def test_what_does_not_split_is_refused(heads, kv_heads, tp, message):
    loaded = random_llama(hidden=heads * 8, heads=heads, kv_heads=kv_heads)
    with pytest.raises(ValueError, match=message):
        make_engine(loaded, tensor_parallel_size=tp)


def test_fp8_cache_is_refused_with_tensor_parallelism(stories):
    with pytest.raises(ValueError, match="fp8"):
        make_engine(stories, tensor_parallel_size=2, kv_cache_dtype="fp8")


# ---- the engine split over processes ----
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_stories_tp2_equals_tp1_under_preemption(stories, mode):
    stats = _compare(stories, STORY_PROMPTS, 2, preemption_mode=mode, **PRESSURE)
    assert stats.num_preemptions > 0 and stats.prefix_hit_rate > 0


@pytest.mark.parametrize("kv_heads", [2, 1])  # GQA split, and MQA's one KV head replicated
def test_random_llama_tp2_equals_tp1(kv_heads):
    loaded = random_llama(num_layers=3, vocab=256, hidden=64, heads=4, kv_heads=kv_heads, seed=kv_heads)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + 6 * i)] for i in range(5)]
    _compare(loaded, prompts, 2, max_tokens=20, block_size=8, max_prefill_chunk=16)


def test_quantized_cache_tp2_equals_tp1(stories):
    """With an int8 cache a code at a rounding boundary may round the other way when the ranks
    sum the K/V projections in another order (1e-7 apart), so the bound is the format's own
    error: TP's logits are nearer TP = 1's than the int8 cache's are to the fp32 cache's."""
    _, exact = run_collecting_logits(make_engine(stories, block_size=8), STORY_PROMPTS[:4], greedy(24))
    _, int8 = run_collecting_logits(make_engine(stories, block_size=8, kv_cache_dtype="int8"), STORY_PROMPTS[:4],
                                    greedy(24))
    _compare(stories, STORY_PROMPTS[:4], 2, kv_cache_dtype="int8", block_size=8, logit_tol=_max_diff(exact, int8))


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(smollm2):
    """9 heads and 3 KV heads over 3 ranks (3 and 1 each), packed Q4_1/Q8_0 weights as loaded,
    batched, in chunks, preempted."""
    tok = smollm2.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Write a haiku about the sea.",
                "What is the capital of Italy?")]
    # three 37-token prompts sharing their first 2 blocks (the system prompt) fit 7 blocks of 16
    # (2 + 3 x 1); growing by 24 tokens they need 2 + 3 x 2
    stats = _compare(smollm2, prompts, 3, max_tokens=24, ignore_eos=True, block_size=16, max_prefill_chunk=32,
                     num_blocks=7, exact=True)
    assert stats.num_preemptions > 0


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_places_the_workers(stories, monkeypatch):
    """The same engine with its worker as a Ray actor, on a Ray started on loopback."""
    import os
    import shutil
    import sys
    import ray
    import tempfile
    from tests.processes import run
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's sockets live under it
    cli = os.path.join(os.path.dirname(sys.executable), "ray")
    try:  # a start that fails half way is stopped too
        run([cli, "start", "--head", "--node-ip-address=127.0.0.1", "--num-cpus=2",
             "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"], check=True)
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
        _compare(stories, STORY_PROMPTS[:3], 2, distributed_executor_backend="ray", block_size=8)
    finally:
        ray.shutdown()
        run([cli, "stop", "--force"])
        shutil.rmtree(temp, ignore_errors=True)
