"""Attention sinks and windows on any model (StreamingLLM): `sliding_window` W and
`attention_sinks` S keep the first S tokens and the last W - S, at positions within the cache.

The reference is the paper's own procedure, written here independently of the engine: one token
at a time, keys cached before RoPE, the cache cut to the sinks and the recent tokens, every key
rotated by its rank in the cache and the query by its own. The engine instead stores keys rotated
at their positions (what every other cache does) and turns a query back to its rank only for the
sinks' scores; the two must agree (fp32, 1e-4), past max_model_len, decoding and prefilling in
chunks, on both attention backends, while every group holds a bounded number of blocks.
"""

import pytest
import torch

from kvserve.core.sampling_params import SamplingParams
from tests.conftest import greedy, make_engine, random_llama, run_collecting_logits


def streaming_reference(model, ids, sinks, window):
    """Logits [len(ids), vocab]: each token decoded from a cache of at most `window` tokens (the
    first `sinks` and the most recent), keys kept before RoPE and rotated by rank at every step."""
    cfg, rope = model.config, model.rope
    H, KVH, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    keys = [[] for _ in model.model.layers]
    values = [[] for _ in model.model.layers]
    out = []
    with torch.inference_mode():
        for tok in ids:
            x = model.model.embed_tokens(torch.tensor([tok]))
            for i, layer in enumerate(model.model.layers):
                a = layer.self_attn
                h = layer.input_layernorm(x)
                keys[i].append(a.k_proj(h).view(KVH, D))
                values[i].append(a.v_proj(h).view(KVH, D))
                if len(keys[i]) > window:  # evict the oldest token after the sinks
                    del keys[i][sinks], values[i][sinks]
                rank = torch.arange(len(keys[i]))
                k = rope(torch.stack(keys[i]), rank).repeat_interleave(H // KVH, dim=1)
                v = torch.stack(values[i]).repeat_interleave(H // KVH, dim=1)
                q = rope(a.q_proj(h).view(1, H, D), rank[-1:])[0]
                probs = (torch.einsum("hd,nhd->hn", q, k) * a.attn.scale).softmax(-1)
                x = x + a.o_proj(torch.einsum("hn,nhd->hd", probs, v).reshape(1, H * D))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            out.append(model.compute_logits(model.model.norm(x))[0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def llama():
    from kvserve.models.registry import build_model
    loaded = random_llama(max_len=256)
    return loaded, build_model(loaded, torch.float32, "cpu", 1024)


def prompt_rows(engine, ids, rid="stream"):
    """Score ids as one prompt (chunked by the engine's budget): each row's logits, in order."""
    rows = []
    stop = engine.on_prompt_logits.add(lambda r, start, logits: rows.append((start, logits.clone())))
    engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0))
    held = []
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        held.append(engine.kv.num_held_blocks(rid))
    stop()
    return torch.cat([r for _, r in sorted(rows, key=lambda r: r[0])]), held


CASES = [  # sinks, window, block size, attention backend
    (4, 24, 4, "torch"), (4, 24, 4, "cpu-kernel"), (0, 24, 4, "cpu-kernel"), (4, 40, 16, "torch"),
    (20, 40, 16, "torch"), (1, 7, 4, "torch"),
]


@pytest.mark.parametrize("sinks,window,block_size,backend", CASES)
def test_streams_past_max_model_len_as_streaming_llm_does(llama, sinks, window, block_size, backend):
    loaded, model = llama
    if backend == "cpu-kernel":
        from tests.conftest import compiled_kernel
        compiled_kernel("paged_attention")
    engine = make_engine(loaded, sliding_window=window, attention_sinks=sinks, max_model_len=64,
                         block_size=block_size, attention_backend=backend, max_num_batched_tokens=16)
    bound = engine.kv.blocks_needed(10 ** 9)
    # generation: 130 tokens from a 10-token prompt with max_model_len 64
    prompt = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    outs, logits = run_collecting_logits(engine, [prompt], greedy(120))
    seq = prompt + list(outs[0].outputs[0].token_ids)
    assert len(seq) == 130 and outs[0].outputs[0].finish_reason == "length"
    ref = streaming_reference(model, seq, sinks, window)
    got = torch.stack(next(iter(logits.values())))
    assert (got - ref[len(prompt) - 1:-1]).abs().max().item() < 1e-4
    # a 150-token prompt scored in chunks of 16
    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    rows, held = prompt_rows(engine, ids)
    assert (rows - streaming_reference(model, ids, sinks, window)).abs().max().item() < 1e-4
    assert max(held) <= bound < engine.kv.blocks_needed(150) + 1
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks  # nothing leaked


def test_a_sink_group_holds_the_sinks_and_the_window_only(llama):
    loaded, _ = llama
    engine = make_engine(loaded, sliding_window=12, attention_sinks=4, block_size=4, max_num_batched_tokens=4)
    rid = engine.add_request(None, list(range(40)), greedy(200))
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        req = engine.scheduler.requests.get(rid)
        if req is not None and req.num_computed_tokens > 24:
            table = engine.kv.block_table(rid)
            null = engine.kv.null_block
            assert table[0] != null  # the sinks' block stays
            assert all(b == null for b in table[1:engine.kv.groups[0].needed_from(req.num_computed_tokens)])
            assert engine.kv.num_held_blocks(rid) <= 1 + 3  # sinks' block + (8 recent + a step of 4)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_prefix_caching_with_sinks_gives_the_same_tokens(llama):
    loaded, _ = llama
    shared = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [shared + [1, 2, 3], shared + [4, 5], shared + [1, 2, 3]]
    results = []
    for caching in (True, False):
        engine = make_engine(loaded, sliding_window=20, attention_sinks=4, block_size=4,
                             enable_prefix_caching=caching, max_num_batched_tokens=32)
        outs = []
        for p in prompts:  # one after another: later ones can hit the earlier ones' blocks
            outs += run_collecting_logits(engine, [p], greedy(30))[0]
        results.append([o.outputs[0].token_ids for o in outs])
        if caching:
            assert engine.kv.prefix_hit_rate > 0.5
    assert results[0] == results[1]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "fp8_e4m3"])
def test_quantized_caches_stream_with_sinks_as_well_as_without(llama, kv_cache_dtype):
    """A quantized cache changes a stream with sinks no more than it changes a dense one."""
    loaded, _ = llama
    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    agreement = []
    for opts in (dict(max_model_len=256), dict(sliding_window=24, attention_sinks=4, max_model_len=64)):
        exact, _ = prompt_rows(make_engine(loaded, block_size=4, max_num_batched_tokens=16, **opts), ids)
        engine = make_engine(loaded, block_size=4, max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype, **opts)
        rows, held = prompt_rows(engine, ids)
        assert max(held) <= engine.kv.blocks_needed(10 ** 9)
        agreement.append((rows.argmax(-1) == exact.argmax(-1)).float().mean().item())
    assert agreement[1] > agreement[0] - 0.1, agreement


@pytest.mark.parametrize("options,message", [
    (dict(sliding_window=300), "larger than the context"),
    (dict(sliding_window=16, attention_sinks=16), "fewer than the sliding window"),
    (dict(attention_sinks=4), "needs a sliding window"),
    (dict(sliding_window=0), "sliding window must be >= 1"),
    (dict(sliding_window=16, attention_sinks=-1), "attention sinks must be >= 0"),
])
def test_impossible_windows_are_named(llama, options, message):
    loaded, _ = llama
    with pytest.raises(ValueError, match=message):
        make_engine(loaded, max_model_len=256, **options)


def test_a_config_that_fixes_its_window_refuses_another(tmp_path):
    transformers = pytest.importorskip("transformers")
    from kvserve.models.registry import load_weights
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
                                     max_position_embeddings=128)
    transformers.MistralForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_weights(str(tmp_path))
    with pytest.raises(ValueError, match="config fixes"):
        make_engine(loaded, sliding_window=16)
    engine = make_engine(loaded, attention_sinks=2)  # sinks within the model's own window
    assert engine.kv.groups[0].spec.sinks == 2 and engine.kv.groups[0].spec.window == 8


def test_sinks_need_rope(llama, monkeypatch):
    from kvserve.models.llama import LlamaForCausalLM
    loaded, _ = llama
    monkeypatch.setattr(LlamaForCausalLM, "rope_for", lambda self, kind: None)
    with pytest.raises(ValueError, match="needs RoPE"):
        make_engine(loaded, sliding_window=16, attention_sinks=4)


def test_max_model_len_past_the_trained_context_warns(llama, caplog):
    loaded, _ = llama
    with caplog.at_level("WARNING", logger="kvserve"):
        engine = make_engine(loaded, max_model_len=512)
    assert engine.max_model_len == 512 and "trained on" in caplog.text
    ids = list(range(100)) * 4
    rows, _ = prompt_rows(engine, ids)  # a dense stream past 256 runs, with positions never trained
    assert rows.shape[0] == 400 and torch.isfinite(rows).all()
