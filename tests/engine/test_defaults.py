"""The defaults the engine picks (--dtype auto, --packed-activations auto) and --exact: the
resolution rule on every case (CPU flags given as data), --exact's conflicts refused by name,
--exact equal to the float path bit for bit, and what the defaults cost on the default GGUF
(SmolLM2-135M Q4_1) against the exact path, within the bounds docs/defaults.md states."""

import json

import pytest
import torch

from kvserve import kernels
from kvserve.config import OptionError, resolve_dtype, resolve_kv_cache_dtype, resolve_packed_activations
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import engine_config
from kvserve.engine.llm_engine import resolve_defaults
from kvserve.eval.perplexity import perplexity
from kvserve.models.packed import PackedLinear, PackedLinearQ8
from kvserve.models.registry import checkpoint_dtype, hf_torch_dtype, published_dtype
from tests.conftest import make_engine, run_collecting_logits
from tests.eval.test_perplexity import shakespeare

GOLDEN = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
          "The KV cache stores the keys and values of"]
AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"})
AVX512_BF16_ONLY = frozenset({"avx512f", "avx512_bf16"})
AMX_ONLY = frozenset({"amx_bf16", "amx_tile"})
AVX2 = frozenset({"avx2", "fma", "f16c"})
# Measured (benchmarks/default_accuracy.py, docs/defaults.md): greedy decoding with the defaults
# parts from the exact path only where the exact path's top two tokens are within 0.19 nats of
# each other (a near-tie an activation rounding tips); on 1,967 tokens of Hamlet perplexity 0.15%
# above the exact path's, mean KL(exact || default) 0.0010 a token, top-1 agreement 98.0% (with
# int8 activations and, on a CPU with bf16 instructions, a bf16 KV cache).
NEAR_TIE_NATS = 0.3  # the defaults never overturn an exact choice made by more than this
PPL_RELATIVE_BOUND = 0.01
KL_BOUND = 0.01


@pytest.mark.parametrize("device, flags, checkpoint, expected", [
    ("cpu", AMX, "bfloat16", "bfloat16"),
    ("cpu", AMX, "float16", "bfloat16"),  # a CPU multiplies bf16, not fp16
    ("cpu", AMX, "float32", "float32"),  # fp32 weights: bf16 would round them
    ("cpu", AMX, "packed", "float32"),  # the packed kernels take fp32 activations
    ("cpu", AVX512_BF16_ONLY, "bfloat16", "bfloat16"),
    ("cpu", AMX_ONLY, "bfloat16", "bfloat16"),
    ("cpu", AVX2, "bfloat16", "float32"),  # bf16 emulated: slower than fp32
    ("cpu", frozenset(), "float16", "float32"),
    ("cpu", AVX2, "packed", "float32"),
    ("cuda", frozenset(), "bfloat16", "bfloat16"),
    ("cuda:1", frozenset(), "float16", "float16"),  # the checkpoint's own 16-bit dtype
    ("cuda", frozenset(), "float32", "bfloat16"),
    ("cuda", AMX, "packed", "bfloat16"),
])
def test_dtype_resolution(device, flags, checkpoint, expected):
    assert resolve_dtype(device, flags, checkpoint) == expected


@pytest.mark.parametrize("weight_dtype, checkpoint, expected", [
    ("float32", "bfloat16", "float32"),  # every matrix dequantized to the named dtype: it is the model's
    ("bfloat16", "packed", "bfloat16"),
    ("int8", "bfloat16", "float32"),  # float matrices packed at load take the packed kernels' fp32
    ("int4", "float16", "float32"),
    ("auto", "bfloat16", "bfloat16"),
])
def test_dtype_resolution_follows_the_weight_dtype(weight_dtype, checkpoint, expected):
    assert resolve_dtype("cpu", AMX, checkpoint, weight_dtype) == expected


def test_dtype_resolution_refuses_an_unknown_checkpoint_dtype():
    with pytest.raises(ValueError, match="checkpoint dtype must be one of .* got 'int3'"):
        resolve_dtype("cpu", AMX, "int3")


@pytest.mark.parametrize("device, flags, checkpoint, weight_dtype, expected", [
    ("cpu", AMX, "packed", "auto", "bfloat16"),  # fp32 only for the packed kernels: a 16-bit cache
    ("cpu", AVX512_BF16_ONLY, "packed", "auto", "bfloat16"),
    ("cpu", AMX_ONLY, "packed", "auto", "bfloat16"),
    ("cpu", AVX2, "packed", "auto", "float32"),  # no bf16 instructions: the model dtype
    ("cpu", frozenset(), "packed", "auto", "float32"),
    ("cpu", AMX, "float32", "auto", "float32"),  # fp32 weights: the model dtype
    ("cpu", AMX, "bfloat16", "auto", "bfloat16"),
    ("cpu", AMX, "bfloat16", "int8", "bfloat16"),  # matrices packed at load
    ("cpu", AVX2, "bfloat16", "int4", "float32"),
    ("cpu", AMX, "packed", "float32", "float32"),  # every matrix dequantized to fp32: the model's dtype
    ("cuda", AMX, "packed", "auto", "bfloat16"),
    ("cuda", frozenset(), "float16", "auto", "float16"),
])
def test_kv_cache_dtype_resolution(device, flags, checkpoint, weight_dtype, expected):
    dtype = resolve_dtype(device, flags, checkpoint, weight_dtype)
    assert resolve_kv_cache_dtype(device, flags, checkpoint, dtype, weight_dtype) == expected


def test_kv_cache_auto_is_resolved_only_with_the_dtype(smollm2):
    """A named --dtype keeps `auto` meaning that dtype; a named cache format is kept; --exact's
    cache is fp32."""
    native = bool(kernels.cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert resolve_defaults(engine_config("preloaded"), smollm2).kv_cache_dtype == (
        "bfloat16" if native else "float32")
    assert resolve_defaults(engine_config("preloaded", dtype="float32"), smollm2).kv_cache_dtype == "float32"
    assert resolve_defaults(engine_config("preloaded", kv_cache_dtype="int8"), smollm2).kv_cache_dtype == "int8"
    assert resolve_defaults(engine_config("preloaded", exact=True), smollm2).kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match="checkpoint dtype must be one of"):
        resolve_kv_cache_dtype("cpu", AMX, "int3", "float32")


def test_packed_activations_resolution():
    assert resolve_packed_activations("cpu", True)[0] == "int8"
    assert resolve_packed_activations("cpu", False) == ("float", resolve_packed_activations("cpu", False)[1])
    assert "not built" in resolve_packed_activations("cpu", False)[1]
    assert resolve_packed_activations("cuda:0", True)[0] == "float"
    assert "CUDA" in resolve_packed_activations("cuda", True)[1]


def test_defaults_are_auto_until_the_checkpoint_is_known():
    config = engine_config()
    assert (config.dtype, config.packed_activations, config.exact) == ("auto", "auto", False)
    assert not config.is_resolved


@pytest.mark.parametrize("options, other", [
    (dict(dtype="bfloat16"), "dtype 'bfloat16'"), (dict(dtype="fp16"), "dtype 'float16'"),
    (dict(packed_activations="int8"), "packed_activations 'int8'")])
def test_exact_conflicts_are_refused_naming_both(options, other):
    with pytest.raises(OptionError, match="exact") as e:
        engine_config(exact=True, **options)
    assert e.value.option == "exact" and other in str(e.value)
    assert e.value.as_flag.startswith("--exact conflicts with")


def test_exact_is_float32_float_products_and_an_fp32_cache_unless_named():
    exact = engine_config(exact=True)
    assert (exact.dtype, exact.packed_activations, exact.kv_cache_dtype) == ("float32", "float", "float32")
    assert exact.is_resolved
    assert engine_config(exact=True, kv_cache_dtype="int8").kv_cache_dtype == "int8"
    same = engine_config(exact=True, dtype="float32", packed_activations="float")  # agreeing choices are fine
    assert (same.dtype, same.packed_activations) == ("float32", "float")


def test_exact_flag_parses_and_conflicts_on_the_command_line(capsys):
    from kvserve.cli import main
    assert main(["generate", "x", "--exact", "--dtype", "bfloat16"]) == 2  # refused before any weight is read
    err = capsys.readouterr().err
    assert "--exact conflicts with dtype 'bfloat16'" in err and "--dtype" in err and "Traceback" not in err


def test_checkpoint_dtypes(smollm2, stories, tmp_path):
    assert checkpoint_dtype(smollm2) == "packed"  # Q4_1 layers, a Q8_0 table
    assert checkpoint_dtype(stories) == "float32"  # llama2.c: fp32
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert hf_torch_dtype(str(tmp_path)) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    assert hf_torch_dtype(str(tmp_path)) == "float16"
    assert published_dtype("llama-3-8b") == "bfloat16" and published_dtype("stories260k") == "float32"


def test_memory_resolves_auto_from_the_published_dtype_and_this_cpu(capsys):
    from kvserve.cli import main
    native = bool(kernels.cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert main(["memory", "--model", "llama-3-8b", "--json"]) == 0  # published in bf16
    r = json.loads(capsys.readouterr().out)
    assert r["weights"]["dtype"] == r["kv_cache_dtype"] == ("bfloat16" if native else "float32")
    assert r["bytes_per_token"] == 2 * 32 * 8 * 128 * (2 if native else 4)
    assert main(["memory", "--model", "stories260k", "--json"]) == 0  # published in fp32
    assert json.loads(capsys.readouterr().out)["kv_cache_dtype"] == "float32"
    assert main(["memory", "--json"]) == 0  # the default GGUF: packed, fp32 activations, the engine's cache
    r = json.loads(capsys.readouterr().out)
    assert (r["weights"]["dtype"], r["kv_cache_dtype"]) == ("float32", "bfloat16" if native else "float32")
    assert main(["memory", "--json", "--dtype", "float32"]) == 0  # a named dtype: auto is that dtype
    assert json.loads(capsys.readouterr().out)["kv_cache_dtype"] == "float32"


def test_a_bf16_checkpoint_resolves_by_the_cpu(tiny_llama):
    """The same weights stored as bf16: bf16 where this CPU multiplies it natively, else fp32."""
    bf16 = type(tiny_llama)(tiny_llama.config, {k: v.to(torch.bfloat16) if v.dim() == 2 else v
                                                for k, v in tiny_llama.state_dict.items()},
                            tiny_llama.tokenizer, tiny_llama.model_id + ":bf16")
    assert checkpoint_dtype(bf16) == "bfloat16"
    config = resolve_defaults(engine_config("preloaded"), bf16)
    native = bool(kernels.cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert config.dtype == ("bfloat16" if native else "float32") and config.is_resolved


def test_the_engine_sees_the_resolved_dtype(smollm2):
    engine = make_engine(smollm2, max_model_len=256)
    assert engine.config.is_resolved and engine.config.dtype == "float32"  # packed: fp32 activations
    cache = "bfloat16" if kernels.cpu_flags() & {"avx512_bf16", "amx_bf16"} else "float32"  # docs/defaults.md
    assert engine.config.kv_cache_dtype == cache and engine.plan.kv_format.name == cache
    expected = "int8" if kernels.load("linear_q8") is not None else "float"
    assert engine.config.packed_activations == expected
    down = engine.model.model.layers[0].mlp.down_proj
    down = getattr(down, "packed", down)  # the int8 module a DenseAbove holds (kvserve.models.products)
    assert isinstance(down, PackedLinearQ8) == (expected == "int8")


def test_exact_equals_the_float_path_bit_for_bit(smollm2):
    exact = make_engine(smollm2, max_model_len=256, exact=True)
    old = make_engine(smollm2, max_model_len=256, packed_activations="float", dtype="float32")
    assert type(exact.model.model.layers[0].mlp.down_proj) is PackedLinear
    params = SamplingParams(temperature=0, max_tokens=16)
    outs_e, logits_e = run_collecting_logits(exact, GOLDEN, params)
    outs_o, logits_o = run_collecting_logits(old, GOLDEN, params)
    for a, b in zip(outs_e, outs_o):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(logits_e[a.request_id], logits_o[b.request_id]):
            assert torch.equal(x, y)


def partings(smollm2, prompts, max_tokens=32):
    """Per prompt, where the defaults' greedy tokens first differ from --exact's and the exact
    path's margin there (top-1 minus top-2 log-probability, nats); None where they never do."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs_d, _ = run_collecting_logits(make_engine(smollm2, max_model_len=256), prompts, params)
    outs_e, logits_e = run_collecting_logits(make_engine(smollm2, max_model_len=256, exact=True), prompts, params)
    found = []
    for a, b in zip(outs_d, outs_e):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        step = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if step is None:
            found.append(None)
            continue
        top2 = torch.log_softmax(logits_e[b.request_id][step].float(), -1).topk(2).values
        found.append((step, (top2[0] - top2[1]).item()))
    return found


def test_defaults_part_from_the_exact_path_only_at_near_ties(smollm2):
    if kernels.load("linear_q8") is None:
        pytest.skip("no int8 kernel here: the defaults are the exact path")
    chat = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    found = partings(smollm2, GOLDEN + [chat, "Water boils at", "In 1492, Columbus"])
    assert all(margin < NEAR_TIE_NATS for _, margin in filter(None, found)), found
    assert found.count(None) >= 1  # and some prompts never part in 32 tokens


def test_defaults_perplexity_within_the_stated_bound_of_exact(smollm2):
    if kernels.load("linear_q8") is None:
        pytest.skip("no int8 kernel here: the defaults are the exact path")
    ids = smollm2.tokenizer.encode(shakespeare())[:700]
    opts = dict(max_model_len=512, max_num_batched_tokens=128, max_prefill_chunk=128, max_num_seqs=1)
    r = perplexity(make_engine(smollm2, **opts), ids, 256, 256, make_engine(smollm2, exact=True, **opts))
    assert abs(r.delta_perplexity) < PPL_RELATIVE_BOUND and 0 < r.mean_kl < KL_BOUND
    assert r.top1_agreement > 0.9
