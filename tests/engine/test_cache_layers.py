"""Selective layer caching (--cache-layers): greedy tokens and logits equal to the full cache's for
every form of the option (last:N, a list with a gap, a fraction), under batching, chunked prefill
and preemption; the storage holds only the cached layers; what cannot be served is refused."""

import pytest
import torch

from kvserve.config import EngineConfig, CacheConfig, OptionError, chosen_cache_layers
from kvserve.core.cache_group import CacheGroupSpec
from kvserve.engine.args import engine_config
from kvserve.models.llama import LlamaForCausalLM
from kvserve.runner.layer_recompute import LayerSelection, check_model, select_cache_layers
from tests.conftest import greedy, make_engine, random_llama, run_collecting_logits
from tests.engine.test_batching import varied_prompts


_REFERENCES: dict = {}


def full_cache_run(loaded, prompts, params, **options):
    """The full cache's outputs and logits, run once per workload (tests compare several settings with it)."""
    key = (id(loaded), repr(prompts), repr(params), repr(sorted(options.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = run_collecting_logits(make_engine(loaded, **options), prompts, params)
    return _REFERENCES[key]


def assert_same_run(loaded, prompts, params, cache_layers, **options):
    """Tokens equal, and every sampled row's logits within 1e-4, with and without --cache-layers."""
    full_outs, full_logits = full_cache_run(loaded, prompts, params, **options)
    engine = make_engine(loaded, cache_layers=cache_layers, **options)
    outs, logits = run_collecting_logits(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in full_outs]
    for ref, got in zip(full_logits.values(), logits.values()):
        assert len(ref) == len(got)
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    assert engine.kv.pool.num_used_blocks == 0
    return engine


@pytest.fixture(scope="module")
def story_prompts(stories):
    return varied_prompts(stories.tokenizer, 5, seed=11, max_words=12)


@pytest.fixture(scope="module")
def tiny_llama_5():
    return random_llama(num_layers=5, seed=3)


# ---- the option's forms ----
@pytest.mark.parametrize("spec, expected", [
    ("all", None), ("last:2", (3, 4)), ("LAST:5", (0, 1, 2, 3, 4)), ("0,2,4", (0, 2, 4)), ("4,1", (1, 4)),
    ("3", (3,)), ("0.25", (3, 4)), ("0.2", (4,)), ("0.5", (2, 3, 4)), ("1.0", (0, 1, 2, 3, 4))])
def test_the_forms_name_these_layers(spec, expected):
    assert chosen_cache_layers(spec, 5) == expected


@pytest.mark.parametrize("spec, problem", [
    ("last:0", "at least one layer"), ("last:x", "expected"), ("some", "expected"), ("0,0", "named twice"),
    ("-1", "numbered from 0"), ("1.5", "(0, 1]"), ("0.0", "(0, 1]"), ("last:6", "has 5 layers"),
    ("5", "layers 0..4")])
def test_bad_values_are_refused_naming_the_problem(spec, problem):
    with pytest.raises(OptionError, match="cache_layers") as e:
        chosen_cache_layers(spec, 5)
    assert problem in str(e.value)


def test_the_form_is_checked_with_the_config_and_reaches_the_flags():
    with pytest.raises(OptionError, match="named twice"):
        CacheConfig(cache_layers="1,1")
    assert engine_config(cache_layers="last:4").cache.cache_layers == "last:4"
    assert EngineConfig().cache.cache_layers == "all"


def test_chosen_layers_below_an_unchosen_one_are_recomputed_without_storage():
    selection = LayerSelection.of("0,2,3,4", 5)
    assert selection is not None
    assert selection.num_recomputed == 2 and selection.cached == (2, 3, 4)
    assert selection.recomputed_though_chosen == (0,)
    assert selection.layer_to_tensor() == (None, None, 0, 1, 2)
    assert "chosen layers [0]" in selection.describe()
    assert LayerSelection.of("all", 5) is None and LayerSelection.of("0,1,2,3,4", 5) is None
    with pytest.raises(ValueError, match="the last layer .4. has no cache"):
        LayerSelection.of("0,1", 5)


# ---- equal to the full cache ----
@pytest.mark.parametrize("spec", ["last:1", "0,2,4", "0.5"])
def test_stories_batched_equal_the_full_cache(stories, story_prompts, spec):
    assert_same_run(stories, story_prompts, greedy(8, ignore_eos=True), cache_layers=spec, block_size=8)


@pytest.mark.parametrize("spec", ["last:2", "1,4"])
def test_random_llama_batched_equals_the_full_cache(tiny_llama_5, spec):
    prompts = [[(7 * i + 3 * j) % 128 for j in range(5 + 4 * i)] for i in range(3)]
    assert_same_run(tiny_llama_5, prompts, greedy(8, ignore_eos=True), cache_layers=spec, block_size=4)


def test_chunked_prefill_equals_the_full_cache(stories, story_prompts):
    long = [p * 2 for p in story_prompts[:2]]
    assert_same_run(stories, long, greedy(4, ignore_eos=True), cache_layers="0,3,4", block_size=8,
                    max_prefill_chunk=7, max_num_batched_tokens=16)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_equals_the_full_cache(stories, story_prompts, mode):
    engine = assert_same_run(stories, story_prompts[:3], greedy(8, ignore_eos=True), cache_layers="last:2",
                             block_size=8, num_blocks=7, preemption_mode=mode, swap_space=1 << 22,
                             max_num_batched_tokens=64)
    assert engine.stats().scheduler.num_preemptions > 0


def test_prefix_caching_hits_equal_the_full_cache(stories, story_prompts):
    shared = stories.tokenizer.encode("Once upon a time there was a little girl named Lily.")
    prompts = [shared + p[1:] for p in story_prompts[:3]]
    engine = assert_same_run(stories, prompts, greedy(6, ignore_eos=True), cache_layers="last:3", block_size=4,
                             max_num_seqs=1)
    assert engine.stats().scheduler.prefix_hit_rate > 0


# ---- storage ----
@pytest.mark.parametrize("spec, num_cached", [("last:1", 1), ("0,2,4", 1), ("0.5", 3), ("last:4", 4)])
def test_the_storage_holds_only_the_cached_layers(stories, spec, num_cached):
    full = make_engine(stories, num_blocks=32, block_size=8)
    engine = make_engine(stories, num_blocks=32, block_size=8, cache_layers=spec)
    c = stories.config
    per_layer_block = 2 * 8 * c.num_key_value_heads * c.head_dim * 4  # K and V, fp32
    assert engine.storage.bytes_per_block == engine.plan.block_bytes == num_cached * per_layer_block
    assert engine.storage.nbytes == 33 * num_cached * per_layer_block  # and the null block
    assert engine.storage.nbytes * c.num_hidden_layers == full.storage.nbytes * num_cached
    assert len(engine.storage.tensors) == num_cached
    with pytest.raises(ValueError, match="layer 0 keeps no K/V"):
        engine.storage.layer_tensors(0)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "fp8_e4m3"])
def test_a_quantized_cache_holds_only_the_cached_layers(stories, story_prompts, kv_cache_dtype):
    full = make_engine(stories, num_blocks=32, block_size=8, kv_cache_dtype=kv_cache_dtype)
    engine = make_engine(stories, num_blocks=32, block_size=8, kv_cache_dtype=kv_cache_dtype, cache_layers="last:2")
    assert engine.storage.bytes_per_block * 5 == full.storage.bytes_per_block * 2 == engine.plan.block_bytes * 5
    outs, _ = run_collecting_logits(engine, story_prompts[:2], greedy(4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_blocks_of_a_selection_never_match_another_cache(stories):
    """A block holds only the cached layers: its prefix hashes (what a disk tier or a peer matches
    on) and its handover identity differ from the full cache's, which stay as they were."""
    full = make_engine(stories, num_blocks=16)
    engine = make_engine(stories, num_blocks=16, cache_layers="last:2")
    assert engine.kv.namespace == (*full.kv.namespace, "cache_layers:3-4") and len(full.kv.namespace) == 4
    assert engine.kv_identity().num_layers == 2 and full.kv_identity().num_layers == 5
    with pytest.raises(ValueError, match="num_layers"):
        engine.kv_identity().check(full.kv_identity())


def test_a_byte_budget_holds_more_blocks(stories):
    full = make_engine(stories, num_blocks=None, kv_cache_memory=1 << 20, block_size=8)
    engine = make_engine(stories, num_blocks=None, kv_cache_memory=1 << 20, block_size=8, cache_layers="last:1")
    assert engine.plan.num_blocks + 1 >= 5 * (full.plan.num_blocks + 1) - 5


# ---- refusals ----
GROUPS = (CacheGroupSpec("full", (0, 1, 2, 3, 4)),)


@pytest.mark.parametrize("options, what", [
    ({"use_cache": False}, "--no-cache"), ({"tensor_parallel_size": 2}, "tensor parallelism"),
    ({"speculative": "ngram"}, "speculative decoding"), ({"enable_lora": True}, "LoRA adapters")])
def test_what_it_cannot_serve_is_refused_by_name(stories, options, what):
    config = engine_config(cache_layers="last:2", **options)
    with pytest.raises(ValueError, match=f"cannot be combined with {what}"):
        select_cache_layers(config, stories.config, GROUPS)


def test_sliding_windows_are_refused(stories):
    with pytest.raises(ValueError, match="sliding windows"):
        make_engine(stories, cache_layers="last:2", sliding_window=32)


def test_a_model_with_its_own_forward_is_refused():
    class OwnForward(LlamaForCausalLM):
        def forward(self, input_ids, positions, ctx):  # a family's own pass (Gemma's scales its embeddings)
            return super().forward(input_ids, positions, ctx)

    with torch.device("meta"):
        model = OwnForward(random_llama(num_layers=2).config)
    with pytest.raises(ValueError, match="OwnForward has its own forward pass"):
        check_model(model)
    with torch.device("meta"):
        check_model(LlamaForCausalLM(random_llama(num_layers=2).config))


def test_an_engine_refuses_a_spec_leaving_no_layer_cached(stories):
    with pytest.raises(ValueError, match="has no cache"):
        make_engine(stories, cache_layers="0,1")


# ---- kvserve memory ----
def test_memory_prints_the_saving(stories_path, capsys):
    from kvserve.cli import main, memory_report
    r = memory_report(stories_path, 512, 2, "auto", 16, cache_layers="last:2")["cache_layers"]
    full = memory_report(stories_path, 512, 2, "auto", 16)
    assert full["cache_layers"] is None
    assert r["cached_layers"] == [3, 4] and r["num_recomputed"] == 3
    assert r["total_bytes"] == full["total_bytes"] * 2 / 5 and r["saving"] == pytest.approx(0.6)
    assert main(["memory", "--model", stories_path, "--context", "512", "--cache-layers", "last:2"]) == 0
    assert "60.0% less" in capsys.readouterr().out
