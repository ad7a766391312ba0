"""The fast path is the model's own modules with their kernel choices bound once
(kvserve.modules): for every architecture the package has, the runner's bound model and its eager
modules give the same tokens and the same logits, bit for bit, over prefill, chunked and decode
steps of several sequences (packed weights with float or int8 activations, every cache format,
a sliding window, attention sinks, bf16). Where the kernels are not built the same runs compare
the eager modules with themselves: nothing binds, and the test says so."""

import pytest
import torch

from kvserve import kernels
from kvserve.modules import FastPath, FastPathEnv, bind_fast_path
from tests.conftest import assert_same_outputs, greedy, make_engine, run_collecting_logits

transformers = pytest.importorskip("transformers")

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"


def layer_kernels_built() -> bool:
    ops = kernels.load("layer_ops")
    return ops is not None and ops.isa() != "portable" and kernels.load("paged_attention") is not None


def fast_and_eager(loaded, prompts, max_tokens=12, **options):
    """Tokens and logits of the same requests through the bound modules and the eager ones."""
    if options.get("packed_activations") == "int8" and kernels.load("linear_q8") is None:
        pytest.skip(f"int8 activations need the compiled linear_q8 kernel: {kernels.failure('linear_q8')}")
    runs = {}
    for fast in (True, False):
        engine = make_engine(loaded, max_num_seqs=4, max_num_batched_tokens=32, **options)
        bound = engine.runner.use_fast_path(fast)
        assert fast or not bound  # eager: nothing bound
        runs[fast] = run_collecting_logits(engine, prompts, greedy(max_tokens, ignore_eos=True)), bound
    return runs


def assert_same(runs):
    assert_same_outputs(runs[True][0], runs[False][0])


def bound_kinds(runs) -> set[str]:
    """The classes whose methods the fast run bound."""
    return {name.rsplit(".", 1)[-1] if "." in name else name for name in runs[True][1]}


@pytest.mark.parametrize("options", [
    dict(weight_dtype="int8"),
    dict(weight_dtype="int4", packed_activations="int8"),
    dict(weight_dtype="int4", kv_cache_dtype="int8"),
    dict(weight_dtype="int4", kv_cache_dtype="int4"),
    dict(weight_dtype="int8", kv_cache_dtype="fp8"),
    dict(weight_dtype="int8", sliding_window=20),
    dict(weight_dtype="int8", sliding_window=16, attention_sinks=4),
    dict(weight_dtype="int8", dtype="bfloat16"),
    dict(weight_dtype="float32"),
], ids=["q8", "q4-int8-act", "int8-cache", "int4-cache", "fp8-cache", "window", "sinks", "bf16", "dense"])
def test_llama2c_fast_path_equals_the_eager_modules(stories, options):
    ids = stories.tokenizer.encode(PROMPT)
    prompts = [ids[:n] for n in (3, 9, 17, 24, 6)]  # more than max_num_seqs: admissions mid-run
    runs = fast_and_eager(stories, prompts, max_tokens=30, **options)
    assert_same(runs)
    if layer_kernels_built() and options.get("weight_dtype") != "float32":
        bound = runs[True][1]
        assert any(k.endswith("self_attn") for k in bound) and any(k.endswith("mlp") for k in bound)
        assert any(k.endswith("attn.attn") or k.endswith("self_attn.attn") for k in bound)


def test_smollm2_fast_path_equals_the_eager_modules(smollm2):
    ids = smollm2.tokenizer.encode("The cache keeps the keys and values of every token it has seen.")
    for acts in ("float", "int8") if kernels.load("linear_q8") is not None else ("float",):
        runs = fast_and_eager(smollm2, [ids[:n] for n in (4, 11, 7)], max_tokens=8, packed_activations=acts)
        assert_same(runs)


def test_smollm2_defaults_fast_path_equals_the_eager_modules_above_the_dense_threshold(smollm2, q8_copies):
    """The defaults' products (packed activations auto): steps of more rows than DenseAbove's
    threshold take its dense path (the AMX tiles, or a bf16 copy) in both runs."""
    from kvserve.models.products import DenseAbove
    ids = smollm2.tokenizer.encode("The cache keeps the keys and values of every token it has seen. " * 12)
    prompts = [ids[:90], ids[:70]]
    runs = {}
    for fast in (True, False):
        engine = make_engine(smollm2, max_num_seqs=4, max_num_batched_tokens=256, packed_activations="auto")
        dense = [m for m in engine.model.modules() if isinstance(m, DenseAbove)]
        if not dense:
            pytest.skip("the defaults keep no dense path on this CPU (no bf16 instructions, or kernels off)")
        assert len(prompts[0]) + len(prompts[1]) > max(m.threshold for m in dense)  # the first step's rows
        bound = engine.runner.use_fast_path(fast)
        runs[fast] = run_collecting_logits(engine, prompts, greedy(6, ignore_eos=True)), bound
    assert_same(runs)


HF_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, rms_norm_eps=1e-6, head_dim=16)
HF_MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_COMMON, num_hidden_layers=2)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**HF_COMMON, num_hidden_layers=2)),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**HF_COMMON, num_hidden_layers=2, sliding_window=8)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **HF_COMMON, num_hidden_layers=2, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=20.0, final_logit_softcapping=15.0)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **HF_COMMON, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24, sliding_window_pattern=3,
        rope_local_base_freq=10000.0, rope_theta=1_000_000.0)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **HF_COMMON, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[0], norm_topk_prob=True)),
}


@pytest.fixture(scope="module", params=list(HF_MODELS))
def hf_loaded(request, tmp_path_factory):
    from kvserve.models.registry import load_weights
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = HF_MODELS[request.param]().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    hf.save_pretrained(path, safe_serialization=True)
    return request.param, load_weights(str(path))


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_every_hf_architecture_fast_path_equals_the_eager_modules(hf_loaded, weights):
    name, loaded = hf_loaded
    prompts = [[(7 * i + j) % 120 + 3 for j in range(n)] for i, n in enumerate((5, 19, 11))]
    runs = fast_and_eager(loaded, prompts, max_tokens=20, weight_dtype=weights)
    assert_same(runs)
    if layer_kernels_built() and name != "gemma2":  # gemma2 soft-caps scores: the kernel does not
        assert any(k.endswith(".attn") for k in runs[True][1]), f"{name}: no attention layer bound"


# ---- the binding itself ----
class Base(FastPath, torch.nn.Module):
    def forward(self, x):
        return x + 1

    def fast_methods(self, env):
        return {"forward": lambda x: x + 1}


class Redefined(Base):
    def forward(self, x):  # a subclass's own forward: Base's fast form is not its
        return x + 2


def test_a_subclass_that_redefines_a_method_keeps_it_eager():
    env = FastPathEnv(torch.device("cpu"), torch.float32)
    base, redefined = Base(), Redefined()
    assert base.bind(env) == ["forward"] and "forward" in base.__dict__
    assert redefined.bind(env) == [] and redefined(torch.zeros(1)).item() == 2
    base.unbind()
    assert "forward" not in base.__dict__ and base.fast_bound == ()


def test_a_subclass_that_redefines_forward_is_called_through_it():
    """kernel_call takes a module's own kernel call only where forward is defined where the call
    is (or above it); runs_fast_form_of only where each replaced method is bound from cls's form."""
    from kvserve.models.llama import RMSNorm
    from kvserve.modules import KernelCall, kernel_call, runs_fast_form_of
    env = FastPathEnv(torch.device("cpu"), torch.float32)

    class Product(torch.nn.Module):
        def forward(self, x):
            return x * 2

        def kernel_call(self, env):
            return KernelCall(torch.mul, (2,), 8, self)

    class Redefined(Product):
        def forward(self, x):
            return x * 3

    assert kernel_call(Product(), env).fn is torch.mul
    redefined = Redefined()
    assert kernel_call(redefined, env).fn == redefined.forward
    assert kernel_call(Product(), FastPathEnv(torch.device("cpu"), torch.bfloat16)).fn != torch.mul

    class OwnAdd(RMSNorm):
        def add_forward(self, x, residual):
            return super().add_forward(x, residual)

    ops = kernels.load("layer_ops")
    env = FastPathEnv(torch.device("cpu"), torch.float32, ops)
    norm, own_add = RMSNorm(8, 1e-6), OwnAdd(8, 1e-6)
    norm.bind(env), own_add.bind(env)
    replaced = ("forward", "add_forward")
    assert runs_fast_form_of(norm, RMSNorm, replaced) == (ops is not None)
    assert not runs_fast_form_of(own_add, RMSNorm, replaced)


def test_children_are_bound_before_their_parents():
    order = []

    class Leaf(FastPath, torch.nn.Module):
        def forward(self, x):
            return x

        def fast_methods(self, env):
            order.append(self)
            return {}

    class Parent(Leaf):
        def __init__(self):
            super().__init__()
            self.a, self.b = Leaf(), Leaf()

    parent = Parent()
    bind_fast_path(parent, FastPathEnv(torch.device("cpu"), torch.float32))
    assert order[-1] is parent and set(order[:2]) == {parent.a, parent.b}


def test_installing_another_backend_after_binding_reaches_it(stories):
    """A bound model given another attention backend (a recording one, as fp8 calibration
    installs) goes back to its eager modules, which call it: no bound form keeps the old one."""
    from kvserve.attention.layer import install
    engine = make_engine(stories, weight_dtype="int8")
    if layer_kernels_built():
        assert engine.runner.fast_path
    calls = []
    backend = engine.runner.backend

    class Recording(type(backend)):
        def forward(self, layer, *args, **kwargs):
            calls.append(layer)
            return super().forward(layer, *args, **kwargs)

    recording = Recording.__new__(Recording)
    recording.__dict__.update(backend.__dict__)
    install(engine.model, recording, [0] * engine.model.config.num_hidden_layers)
    assert not engine.runner.model.model.layers[0].self_attn.fast_bound
    run_collecting_logits(engine, [stories.tokenizer.encode(PROMPT)[:5]], greedy(3, ignore_eos=True))
    assert calls and set(calls) == set(range(engine.model.config.num_hidden_layers))


def test_no_binding_without_the_layer_kernels(stories, monkeypatch):
    """Kernels off (or not built): norms, MLPs and q|k|v products keep their eager forms, and the
    engine decodes through them."""
    from kvserve.runner import model_runner
    monkeypatch.setattr(model_runner.kernels, "load", lambda name, isa=None: None)
    engine = make_engine(stories, weight_dtype="int8")
    assert not any(k.endswith(("mlp", "self_attn", "norm", "layernorm")) for k in engine.runner.fast_path)
    out, _ = run_collecting_logits(engine, [stories.tokenizer.encode(PROMPT)[:5]], greedy(4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
