"""LoRA adapters: PEFT adapters of random weights on a tiny random Llama give transformers + peft's
greedy tokens and logits, rows of the base model and of two adapters mixed in one batch each give
their solo result, fused products take each module's delta on its own columns, the prefix cache
never shares blocks across adapters, and what is not served is refused by name."""

import copy
import json

import pytest
import torch

from kvserve.core.sampling_params import LoRARequest, SamplingParams
from kvserve.models.lora import LoRAError, LoRALinear
from tests.conftest import greedy, make_engine, run_collecting_logits

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[3, 17, 42, 9, 88, 5, 61, 23, 7, 19], [11, 2, 99, 4], [50, 51, 52, 53, 54, 55, 56]]


def save_adapter(base, path, seed, **config):
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random Llama (saved as a Hugging Face directory) and two adapters of it."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(cfg).eval()
    base.save_pretrained(root / "base", safe_serialization=True)
    save_adapter(base, root / "a1", 1, r=4, lora_alpha=8, target_modules=ALL)
    save_adapter(base, root / "a2", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                 use_rslora=True)
    from kvserve.models.registry import load_weights
    return dict(root=root, base=base, loaded=load_weights(str(root / "base")))


def reference(setup, adapter, ids, steps):
    """transformers (+ peft) greedy tokens and each step's logits, by full recomputation."""
    model = setup["base"] if adapter is None else peft.PeftModel.from_pretrained(
        copy.deepcopy(setup["base"]), str(setup["root"] / adapter)).eval()
    seq, tokens, logits = list(ids), [], []
    with torch.no_grad():
        for _ in range(steps):
            row = model(torch.tensor([seq])).logits[0, -1]
            logits.append(row)
            tokens.append(int(row.argmax()))
            seq.append(tokens[-1])
    return tokens, torch.stack(logits)


def lora_engine(setup, **options):
    modules = [f"a1={setup['root'] / 'a1'}", f"a2={setup['root'] / 'a2'}"]
    return make_engine(setup["loaded"], lora_modules=modules, block_size=4, num_blocks=128, **options)


@pytest.mark.parametrize("adapter", [None, "a1", "a2"])
def test_greedy_tokens_and_logits_equal_transformers_with_peft(setup, adapter):
    engine = lora_engine(setup)
    params = greedy(6, lora_request=adapter)
    (out,), logits = run_collecting_logits(engine, [PROMPTS[0]], params)
    tokens, ref = reference(setup, adapter, PROMPTS[0], 6)
    assert out.outputs[0].token_ids == tokens
    assert (torch.stack(next(iter(logits.values()))) - ref).abs().max().item() < 1e-4


def test_adapters_change_the_output(setup):
    """The adapters are not no-ops (else the equalities above would prove nothing)."""
    base, _ = reference(setup, None, PROMPTS[0], 6)
    assert reference(setup, "a1", PROMPTS[0], 6)[0] != base
    assert reference(setup, "a2", PROMPTS[0], 6)[0] != base


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_mixed_batch_gives_every_row_its_solo_result(setup, use_cache):
    """Base rows, a1 rows and a2 rows in one batch (and one step: prompts and decodes mixed)."""
    work = [(p, a) for p in PROMPTS for a in (None, "a1", "a2")]
    engine = lora_engine(setup, use_cache=use_cache)
    rids = [engine.add_request(None, p, greedy(5, lora_request=a)) for p, a in work]
    done = {}
    while engine.has_unfinished():
        assert engine.scheduler.has_unfinished()
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for rid, (prompt, adapter) in zip(rids, work):
        assert done[rid] == reference(setup, adapter, prompt, 5)[0], (prompt, adapter)


def test_the_prefix_cache_never_shares_blocks_across_adapters(setup):
    engine = lora_engine(setup)
    prompt = list(range(1, 18))  # four full blocks of 4

    def cached(adapter):
        rid = engine.add_request(None, prompt, greedy(2, lora_request=adapter))
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    result = out.num_cached_tokens
        engine.check_integrity()
        return result

    assert cached("a1") == 0
    assert cached("a2") == 0  # the same prompt under another adapter
    assert cached(None) == 0  # and the base model
    assert cached("a1") == 16  # the same adapter again: its blocks are found
    assert cached(None) == 16
    engine.unload_lora("a1")  # a new load under the same name is another adapter
    engine.load_lora("a1", str(setup["root"] / "a1"))
    assert cached("a1") == 0


def test_unload_is_refused_while_a_request_runs_the_adapter(setup):
    engine = lora_engine(setup)
    rid = engine.add_request(None, PROMPTS[1], greedy(8, lora_request="a2"))
    engine.step()
    with pytest.raises(LoRAError, match=r"'a2' is in use by 1 unfinished request"):
        engine.unload_lora("a2")
    engine.abort(rid)
    assert engine.unload_lora("a2").name == "a2"
    assert [a.name for a in engine.lora_adapters()] == ["a1"]
    with pytest.raises(LoRAError, match="unknown LoRA adapter 'a2'; loaded: \\['a1'\\]"):
        engine.add_request(None, PROMPTS[1], greedy(2, lora_request="a2"))


def test_llm_generate_takes_lora_request_and_loads_a_path(setup):
    from tests.conftest import make_llm
    llm = make_llm(setup["loaded"], enable_lora=True, block_size=4)
    req = LoRARequest("first", 0, str(setup["root"] / "a1"))
    outs = llm.generate([PROMPTS[0], PROMPTS[0]], greedy(4), lora_request=[req, None])
    assert outs[0].outputs[0].token_ids == reference(setup, "a1", PROMPTS[0], 4)[0]
    assert outs[1].outputs[0].token_ids == reference(setup, None, PROMPTS[0], 4)[0]
    assert llm.generate([PROMPTS[0]], greedy(4), lora_request="first")[0].outputs[0].token_ids == \
           outs[0].outputs[0].token_ids
    with pytest.raises(LoRAError, match="has id 1, not 7"):
        llm.generate([PROMPTS[0]], greedy(4), lora_request=LoRARequest("first", 7))


def test_fused_products_take_each_modules_delta_on_its_columns():
    """q|k|v packed and fused (kvserve.models.packed.fuse): the wrapper on the fused product adds
    q's, k's and v's deltas each to its own columns, only on the adapter's rows."""
    from kvserve.models.lora import LoRAAdapter, stack_pairs
    from kvserve.models.packed import FORMATS, FusedPacked, PackedLinear, quantize
    g = torch.Generator().manual_seed(0)
    sizes = {"q_proj": 64, "k_proj": 32, "v_proj": 32}
    parts = [PackedLinear(quantize(torch.randn(n, 64, generator=g), FORMATS["q8_0"])) for n in sizes.values()]
    group = FusedPacked(parts)
    weights = {(0, n): (torch.randn(4, 64, generator=g), torch.randn(sizes[n], 4, generator=g))
               for n in ("q_proj", "v_proj")}

    class Step:  # the adapter set's part a wrapper reads (held weakly by it: kept here)
        step = []
    owner = Step()
    wrapped = LoRALinear(group.fused, 0, [("q_proj", 0, 64), ("k_proj", 64, 96), ("v_proj", 96, 128)], owner)
    adapter = LoRAAdapter("a", 1, "/a", 4, 0.5, weights, {wrapped.key: stack_pairs(weights, wrapped)})
    owner.step = [(adapter, torch.tensor([1, 3]))]
    x = torch.randn(4, 64, generator=g)
    got = wrapped(x)
    for rows, adapted in (([0, 2], False), ([1, 3], True)):
        for (name, n), part, start in zip(sizes.items(), parts, (0, 64, 96)):
            want = part(x[rows])
            if adapted and name in ("q_proj", "v_proj"):
                a, b = weights[(0, name)]
                want = want + 0.5 * (x[rows] @ a.t()) @ b.t()
            assert torch.allclose(got[rows, start:start + n], want, atol=1e-5), (name, rows)


def test_packed_weights_with_adapters_keep_mixed_rows_apart(setup):
    """int8 weights (fused q|k|v and gate|up products): an adapter row in a batch equals its solo
    run, and the base rows equal the engine without LoRA."""
    plain = make_engine(setup["loaded"], weight_dtype="int8", block_size=4, exact=True)
    base = [o.outputs[0].token_ids for o in run_collecting_logits(plain, PROMPTS, greedy(5))[0]]
    assert plain.model.model.layers[0].self_attn.fused_qkv is not None
    engine = lora_engine(setup, weight_dtype="int8", exact=True)
    mixed = [engine.add_request(None, p, greedy(5, lora_request=a)) for p in PROMPTS for a in (None, "a1")]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    solo = lora_engine(setup, weight_dtype="int8", exact=True)
    alone = [o.outputs[0].token_ids for o in run_collecting_logits(solo, PROMPTS, greedy(5, lora_request="a1"))[0]]
    assert [done[r] for r in mixed] == [t for pair in zip(base, alone) for t in pair]
    assert alone != base


def test_no_lora_wraps_nothing_and_keeps_the_fast_path(setup):
    from kvserve.models.lora import LoRALinear as Wrapper
    plain = make_engine(setup["loaded"], block_size=4)
    assert plain.lora is None and not any(isinstance(m, Wrapper) for m in plain.model.modules())
    engine = lora_engine(setup)
    assert sum(isinstance(m, Wrapper) for m in engine.model.modules()) == 2 * 7
    assert engine.runner.fast_path == plain.runner.fast_path  # the same modules bind with adapters served
    base = run_collecting_logits(plain, PROMPTS, greedy(4))[0]
    with_lora = run_collecting_logits(engine, PROMPTS, greedy(4))[0]
    assert [o.outputs[0].token_ids for o in base] == [o.outputs[0].token_ids for o in with_lora]


@pytest.mark.parametrize("change,named", [
    ({"use_dora": True}, "use_dora"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"), ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern")])
def test_unserved_adapter_features_are_refused_by_name(setup, tmp_path, change, named):
    import shutil
    shutil.copytree(setup["root"] / "a1", tmp_path / "x")
    config = json.loads((tmp_path / "x" / "adapter_config.json").read_text())
    (tmp_path / "x" / "adapter_config.json").write_text(json.dumps({**config, **change}))
    engine = lora_engine(setup)
    with pytest.raises(LoRAError, match=named):
        engine.load_lora("x", str(tmp_path / "x"))


def test_bad_names_paths_and_options_are_refused(setup, tmp_path):
    plain = make_engine(setup["loaded"], block_size=4)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.add_request(None, PROMPTS[0], greedy(2, lora_request="a1"))
    engine = lora_engine(setup, max_loras=2)
    with pytest.raises(LoRAError, match="2 LoRA adapters are loaded, the most max_loras allows"):
        engine.load_lora("y", str(setup["root"] / "a1"))
    with pytest.raises(LoRAError, match="already loaded"):
        engine.load_lora("a1", str(setup["root"] / "a2"))
    engine.unload_lora("a2")
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        engine.load_lora("y", str(tmp_path))
    with pytest.raises(LoRAError, match="is not a directory"):
        engine.load_lora("y", str(tmp_path / "missing"))
    with pytest.raises(LoRAError, match="rank 4, above max_lora_rank 2"):
        lora_engine(setup, max_lora_rank=2)
    from kvserve.config import OptionError
    with pytest.raises(OptionError, match="name=path"):
        make_engine(setup["loaded"], lora_modules=["nopath"])
    with pytest.raises(OptionError, match="lora_request"):
        SamplingParams(lora_request=3)


def test_the_flags_declare_adapters_once():
    """--lora-modules takes several name=path items (vLLM's spelling), as LLM(...) takes them."""
    import argparse
    from kvserve.engine.args import add_engine_args, engine_config, engine_options
    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "3", "--max-lora-rank", "8"])
    lora = engine_config(**engine_options(a)).lora
    assert (lora.modules, lora.max_loras, lora.max_lora_rank, lora.enabled) == \
           ((("sql", "/a/sql"), ("chat", "/a/chat")), 3, 8, True)
    assert engine_config(lora_modules={"sql": "/a/sql"}).lora.modules == (("sql", "/a/sql"),)
    assert not engine_config().lora.enabled
    from kvserve.config import OptionError
    with pytest.raises(OptionError, match="names an adapter twice"):
        engine_config(lora_modules=["a=/x", "a=/y"])


def test_the_host_tier_keeps_adapters_apart_and_a_disk_tier_is_refused(setup, tmp_path):
    """Blocks an adapter's request wrote, evicted from the pool to the host tier, come back to the
    same adapter as cached tokens, never to the base model or another adapter."""
    modules = [f"a1={setup['root'] / 'a1'}", f"a2={setup['root'] / 'a2'}"]
    engine = make_engine(setup["loaded"], lora_modules=modules, block_size=4, num_blocks=16,
                         kv_cache_host_bytes=1 << 20)
    prompt = list(range(1, 18))  # four full blocks of 4

    def cached(adapter, ids=prompt):
        rid = engine.add_request(None, ids, greedy(2, lora_request=adapter))
        result = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    result = out.num_cached_tokens
        engine.check_integrity()
        return result

    def evict_all():
        cached(None, list(range(60, 118)))  # 15 blocks of another prompt: the pool evicts the rest
        engine.flush_kv_tiers()

    assert cached("a1") == 0
    evict_all()
    assert cached(None) == 0 and cached("a2") == 0  # the base model, another adapter: nothing
    evict_all()
    assert cached("a1") == 16  # the same adapter: its blocks come back from the host tier
    assert engine.tiers is not None
    with pytest.raises(ValueError, match="kv-cache-dir"):
        make_engine(setup["loaded"], lora_modules=modules, kv_cache_dir=str(tmp_path))


def test_a_dropped_lora_engine_frees_its_wrapped_products_at_once(setup):
    """The adapter set holds its wrappers and each wrapper its set only weakly: no reference cycle
    keeps a dropped engine's wrapped products (and the weights they hold) until a collection."""
    import gc
    import weakref
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        engine = lora_engine(setup)
        run_collecting_logits(engine, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3,
                                                                  lora_request=LoRARequest("a1")))
        held = [weakref.ref(engine.model)] + [weakref.ref(m) for m in engine.model.modules()
                                              if isinstance(m, LoRALinear)]
        del engine
        assert len(held) > 1 and all(m() is None for m in held)
    finally:
        if was_enabled:
            gc.enable()
