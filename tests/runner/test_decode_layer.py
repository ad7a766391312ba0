"""A decoder layer's decode step as one compiled call (layer_ops' DecodeLayer): where a layer's
blocks run their fast forms over packed products and a dense or int8 cache, a step of plain
decodes goes through one call a layer, and gives what the blocks called one by one give (the
same kernels in the same order), bit for bit: tokens and every step's logits, against the fast
path without it (FastPathEnv.fused off) and the eager modules. Where it does not apply (another
cache format, attention sinks, a dense model, kernels not built) the layers are called as before."""

import dataclasses

import pytest
import torch

from kvserve import kernels
from kvserve.models.llama import LlamaDecoderLayer
from tests.conftest import assert_same_outputs, greedy, make_engine, random_llama, run_collecting_logits

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"


def fused_built(*products: str) -> bool:
    """Whether layers can run as one call here: layer_ops' vector build (the MLP's fast form needs
    it), the attention kernel and the products' kernels."""
    ops = kernels.load("layer_ops")
    needed = ("paged_attention", *products)
    return (ops is not None and ops.isa() != "portable" and hasattr(ops, "DecodeLayer")
            and all(kernels.load(k) is not None for k in needed))


def fused_layers(engine) -> int:
    """How many decoder layers are bound to run a step of plain decodes as one call."""
    return sum(1 for m in engine.model.modules() if isinstance(m, LlamaDecoderLayer)
               and getattr(m.__dict__.get("forward"), "__name__", "") == "fused_forward")


def count_one_calls(monkeypatch, name: str, calls: list[int]) -> None:
    """Each forward(x, ...) of layer_ops' class `name` (DecodeLayer, DecodeStack) counted into
    calls (x's rows), through a wrapper; a wrapped DecodeLayer is no DecodeLayer of layer_ops, so
    no DecodeStack takes it."""
    ops = kernels.load("layer_ops")
    if ops is None or not hasattr(ops, name):
        return
    one_call = getattr(ops, name)

    class Counted:
        def __init__(self, *args):
            self.op = one_call(*args)

        def forward(self, x, *rest):
            calls.append(x.shape[0])
            return self.op.forward(x, *rest)
    monkeypatch.setattr(ops, name, Counted)


@pytest.fixture
def one_calls(monkeypatch):
    """The rows of each layer step run as one compiled call (layer_ops' DecodeLayer, counted)."""
    calls: list[int] = []
    count_one_calls(monkeypatch, "DecodeLayer", calls)
    return calls


def three_ways(loaded, prompts, max_tokens, calls, max_num_seqs=4, **options):
    """Tokens and logits through the fused layers, the fast path without them and the eager
    modules; how many layers each binds fused, and how many layer steps each ran as one call."""
    runs = {}
    for name, fast, fused in (("fused", True, True), ("unfused", True, False), ("eager", False, False)):
        engine = make_engine(loaded, max_num_seqs=max_num_seqs, max_num_batched_tokens=32, **options)
        engine.runner.use_fast_path(fast, fused=fused)
        before = len(calls)
        outputs = run_collecting_logits(engine, prompts, greedy(max_tokens, ignore_eos=True))
        runs[name] = outputs, fused_layers(engine), calls[before:]
    return runs


def check(loaded, prompts, max_tokens, layers, fuses, calls, **options):
    """The three runs agree bit for bit; the fused one binds every layer and runs decode steps as
    one call where `fuses`, and none otherwise. Returns the rows of each step run as one call."""
    runs = three_ways(loaded, prompts, max_tokens, calls, **options)
    assert_same_outputs(runs["fused"][0], runs["unfused"][0])
    assert_same_outputs(runs["fused"][0], runs["eager"][0])
    assert runs["unfused"][1] == runs["eager"][1] == 0 and runs["unfused"][2] == runs["eager"][2] == []
    assert runs["fused"][1] == (layers if fuses else 0)
    assert bool(runs["fused"][2]) == fuses
    return runs["fused"][2]


# (options, the product kernel the layers' products take, whether a plain decode step runs as one
# call). The defaults' products (packed activations auto) are linear_q8's for Q8_0 and Q4_1.
CASES = {
    "q8": (dict(weight_dtype="int8"), "linear_q8", True),
    "q8-float-act": (dict(weight_dtype="int8", packed_activations="float"), "linear_quant", True),
    "q4-int8-act": (dict(weight_dtype="int4", packed_activations="int8"), "linear_q8", True),
    "int8-cache": (dict(weight_dtype="int4", kv_cache_dtype="int8"), "linear_q8", True),
    "fp32-cache": (dict(weight_dtype="int8", kv_cache_dtype="float32"), "linear_q8", True),
    "window": (dict(weight_dtype="int8", sliding_window=12), "linear_q8", True),
    "fp8-cache": (dict(weight_dtype="int8", kv_cache_dtype="fp8"), "linear_q8", False),  # no one-call write
    "int4-cache": (dict(weight_dtype="int4", kv_cache_dtype="int4"), "linear_q8", False),
    "dense": (dict(weight_dtype="float32"), "linear_q8", False),  # torch's products: no compiled operation
}


@pytest.mark.parametrize("case", CASES)
def test_fused_layers_equal_the_blocks_called_one_by_one(case, one_calls):
    options, product, fuses = CASES[case]
    if options.get("packed_activations") == "int8" and kernels.load("linear_q8") is None:
        pytest.skip(f"int8 activations need the compiled linear_q8 kernel: {kernels.failure('linear_q8')}")
    loaded = random_llama(num_layers=3, hidden=64, heads=4, kv_heads=2, seed=5)
    prompts = [[(7 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate((3, 9, 17, 24, 6))]
    check(loaded, prompts, 30, 3, fuses and fused_built(product), one_calls, **options)


def test_attention_sinks_bind_the_one_call_and_never_take_it(one_calls):
    """A group with sinks has no plain decode step: the layers are bound, every step unfused."""
    loaded = random_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, seed=6)
    prompts = [[(5 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate((7, 19, 4))]
    runs = three_ways(loaded, prompts, 24, one_calls, weight_dtype="int8", sliding_window=16,
                      attention_sinks=4)
    assert_same_outputs(runs["fused"][0], runs["unfused"][0])
    assert_same_outputs(runs["fused"][0], runs["eager"][0])
    assert runs["fused"][1] == (2 if fused_built("linear_q8") else 0) and runs["fused"][2] == []


def test_more_rows_than_a_product_kernel_takes_go_one_by_one(one_calls):
    """Float activations: linear_quant takes up to FEW_ROWS rows; a step of more decodes calls the
    blocks (its products dequantize), a step of fewer runs as one call."""
    from kvserve.models.packed import FEW_ROWS
    loaded = random_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, seed=7)
    prompts = [[(11 * i + j) % 120 + 2 for j in range(3 + i % 4)] for i in range(FEW_ROWS + 3)]
    fuses = fused_built("linear_quant")
    rows = check(loaded, prompts, 12, 2, fuses, one_calls, max_num_seqs=FEW_ROWS + 3, weight_dtype="int8",
                 packed_activations="float")
    assert all(r <= FEW_ROWS for r in rows)


def test_wide_weights_fuse_too(tmp_path, one_calls):
    """F16 matrices under an fp32 model: linear_wide's products as compiled operations."""
    from kvserve.models.registry import load_weights
    from tests.models.test_wide_weights import tiny_llama, write_llama_gguf
    path = tmp_path / "llama-F16.gguf"
    write_llama_gguf(path, tiny_llama(False), "F16")
    loaded = load_weights(str(path))
    prompts = [[5, 9, 33, 2, 71], [11, 4], [100, 3, 8, 64, 27, 13, 90]]
    check(loaded, prompts, 10, 2, fused_built("linear_wide"), one_calls, dtype="float32")


def test_stories_down_projection_is_not_packed_so_nothing_fuses(stories, one_calls):
    """stories260K's MLP is 172 wide, no whole number of 32-blocks: its down_proj stays a torch
    product, so its layers are called one by one (and give what the eager modules give)."""
    ids = stories.tokenizer.encode(PROMPT)
    layers = stories.config.num_hidden_layers
    check(stories, [ids[:n] for n in (3, 9, 17)], 12, layers, False, one_calls, weight_dtype="int8")


def kquant_llama():
    """A 2-layer Llama whose layer matrices are random valid Q4_K blocks."""
    from tests.kernels.kquant_blocks import random_packed
    loaded = random_llama(num_layers=2, hidden=256, heads=4, kv_heads=2, seed=3)

    def packed(i, name, v):
        layer_matrix = name.startswith("model.layers.") and v.dim() == 2
        return random_packed(*v.shape, "q4_k", seed=i, scale=0.002) if layer_matrix else v
    sd = {name: packed(i, name, v) for i, (name, v) in enumerate(loaded.state_dict.items())}
    return dataclasses.replace(loaded, state_dict=sd)


KQUANT_PROMPTS = [[5, 9, 33, 2, 71], [11, 4], [100, 3, 8, 64, 27, 13, 90]]


@pytest.mark.parametrize("acts", ["float", "int8"])
def test_k_quant_products_fuse_too(acts, one_calls):
    """Q4_K matrices: linear_kquant's products (fp32 or int8 activations) as compiled operations."""
    if acts == "int8" and kernels.load("linear_kquant") is None:
        pytest.skip(f"int8 activations need the compiled linear_kquant: {kernels.failure('linear_kquant')}")
    fuses = fused_built("linear_kquant")
    check(kquant_llama(), KQUANT_PROMPTS, 10, 2, fuses, one_calls, packed_activations=acts)


def test_smollm2_defaults_fuse_every_layer(smollm2, one_calls):
    ids = smollm2.tokenizer.encode("The cache keeps the keys and values of every token it has seen.")
    layers = smollm2.config.num_hidden_layers
    check(smollm2, [ids[:n] for n in (4, 11, 7)], 8, layers, fused_built("linear_q8"), one_calls)


def test_operations_refuse_what_they_do_not_take():
    if not all(kernels.load(k) is not None for k in ("layer_ops", "linear_q8", "paged_attention")):
        pytest.skip("needs the compiled layer_ops, paged_attention and linear_q8 kernels")
    ops, q8, attention = kernels.load("layer_ops"), kernels.load("linear_q8"), kernels.load("paged_attention")
    w = torch.zeros(32, 20, dtype=torch.uint8)  # one group of two panels (16 rows of W and 16 of padding)
    with pytest.raises(RuntimeError, match="linear_q8, not linear_quant"):
        q8.rows_op("linear_quant", w, 3, 32, 16, None)
    cache = [torch.zeros(4, 16, 2, 8)] * 2
    with pytest.raises(RuntimeError, match="dense or an int8 cache, not fp8"):
        attention.decode_op("fp8", cache, 1.0)
    with pytest.raises(RuntimeError, match="int8 cache takes 4 tensors, not 2"):
        attention.decode_op("int8", cache, 1.0)
    product, decode = q8.rows_op("linear_q8", w, 3, 32, 16, None), attention.decode_op("dense", cache, 1.0)
    norm = torch.ones(32)
    with pytest.raises(TypeError, match="kvserve.RowsOp capsule"):  # a decode op where a product goes
        ops.DecodeLayer(norm, 1e-5, norm, 1e-5, decode, product, product, product, decode, 2, 1, "store_kv",
                        cache)
    with pytest.raises(RuntimeError, match="store_kv or store_kv_int8, not store_kv_fp8"):
        ops.DecodeLayer(norm, 1e-5, norm, 1e-5, product, product, product, product, decode, 2, 1,
                        "store_kv_fp8", cache)
    with pytest.raises(RuntimeError, match="store_kv_int8 writes an int8 cache, not Float"):
        ops.DecodeLayer(norm, 1e-5, norm, 1e-5, product, product, product, product, decode, 2, 1,
                        "store_kv_int8", cache * 2)
    with pytest.raises(RuntimeError, match=r"heads \(3\) must be a positive multiple of kv_heads \(2\)"):
        ops.DecodeLayer(norm, 1e-5, norm, 1e-5, product, product, product, product, decode, 3, 2, "store_kv",
                        cache)
    with pytest.raises(RuntimeError, match="W holds 32 panel rows, not panels of 40"):
        q8.rows_op("linear_q8", w, 3, 32, 40, None)
    wide = q8.rows_op("linear_q8", torch.zeros(32, 20, dtype=torch.uint8), 3, 32, 32, None)  # 32 columns
    for o, down in ((product, wide), (wide, product)):  # either of 16 columns where the norms take 32
        with pytest.raises(RuntimeError, match=r"o and down give hidden \(32\) columns"):
            ops.DecodeLayer(norm, 1e-5, norm, 1e-5, product, o, product, down, decode, 2, 1, "store_kv",
                            cache)
    for w1, w2 in ((norm, torch.ones(64)[::2]), (torch.ones(64)[::2], norm), (norm, norm.double())):
        with pytest.raises(RuntimeError, match="the two norms' weights: contiguous CPU"):
            ops.DecodeLayer(w1, 1e-5, w2, 1e-5, product, wide, product, wide, decode, 2, 1, "store_kv", cache)
    with pytest.raises(RuntimeError, match=r"16 columns are not \(heads \+ 2 kv_heads\) heads"):
        ops.DecodeLayer(norm, 1e-5, norm, 1e-5, product, product, product, product, decode, 3, 1, "store_kv",
                        cache)


def test_every_packed_products_kernel_hands_its_product_over():
    """Each kernel a packed weight's products take (its format's, int8 activations' linear_q8)
    has rows_op, so no packed format's layers fall back for want of it."""
    from kvserve.models.packed import FORMATS, WIDE_FORMATS
    names = {f.kernel for f in (*FORMATS.values(), *WIDE_FORMATS.values())} | {"linear_q8"}
    built = {name: kernels.load(name) for name in sorted(names)}
    if not any(built.values()):
        pytest.skip("no product kernel is built (kernels off)")
    assert [name for name, m in built.items() if m is not None and not hasattr(m, "rows_op")] == []


def test_a_product_hands_over_only_the_operation_of_its_own_kernel_call():
    """rows_op(call) counts where the class that defines kernel_call defines it: a subclass that
    redefines kernel_call alone makes calls its parent's rows_op does not know, and neither it
    nor a DenseAbove holding it hands an operation over (its layer runs its blocks one by one)."""
    from types import SimpleNamespace

    from kvserve.models.products import DenseAbove
    from kvserve.modules import KernelCall, has_rows_op

    class Product:
        def kernel_call(self, env):
            return None

        def rows_op(self, call):
            return "operation"

    class OtherCall(Product):
        def kernel_call(self, env):
            return None

    class Both(OtherCall):
        def kernel_call(self, env):
            return None

        def rows_op(self, call):
            return "its own operation"

    class OtherOperation(OtherCall):  # rows_op below the class whose kernel_call it would take
        def rows_op(self, call):
            return "an operation"

    assert has_rows_op(Product()) and not has_rows_op(OtherCall()) and has_rows_op(Both())
    assert not has_rows_op(OtherOperation()) and not has_rows_op(SimpleNamespace())
    call = KernelCall(print, (), 8, None)
    assert DenseAbove.rows_op(SimpleNamespace(packed=Product()), call) == "operation"
    assert DenseAbove.rows_op(SimpleNamespace(packed=OtherCall()), call) is None
    assert DenseAbove.rows_op(SimpleNamespace(packed=Both()), call) == "its own operation"


@pytest.fixture
def stack_calls(monkeypatch):
    """The steps a model runs through all its layers in one compiled call (layer_ops'
    DecodeStack, counted): the rows of each."""
    calls: list[int] = []
    count_one_calls(monkeypatch, "DecodeStack", calls)
    return calls


STACK_CASES = {  # (a CASES entry, options added): and more sequences than linear_quant's rows, sinks
    **{case: (case, {}) for case in ("q8", "q4-int8-act", "int8-cache", "window", "fp8-cache")},
    "more-rows": ("q8-float-act", {}),
    "sinks": ("window", {"attention_sinks": 4}),
}


@pytest.mark.parametrize("case", STACK_CASES)
def test_a_model_whose_layers_all_fuse_runs_them_in_one_call(case, stack_calls, monkeypatch):
    """Every layer one call: a step of plain decodes goes through all of them in one call, and
    gives what the layers one by one and the eager modules give, bit for bit; it runs at exactly
    the steps, and over the rows, where each layer would run one call (counted in a run without
    the stack), so none where the layers do not fuse (an fp8 cache) or a step is no plain decode
    (sinks), and not the steps of more rows than float activations' kernel takes."""
    from kvserve.models.packed import FEW_ROWS
    base, extra = STACK_CASES[case]
    options, product, fuses = CASES[base]
    options = {**options, **extra}
    seqs = FEW_ROWS + 3 if case == "more-rows" else 4
    if options.get("packed_activations") == "int8" and kernels.load("linear_q8") is None:
        pytest.skip(f"int8 activations need the compiled linear_q8 kernel: {kernels.failure('linear_q8')}")
    loaded = random_llama(num_layers=3, hidden=64, heads=4, kv_heads=2, seed=8)
    lengths = [(4, 11, 19, 2)[i % 4] + i // 4 for i in range(seqs)]
    prompts = [[(5 * i + 7 * j) % 120 + 2 for j in range(n)] for i, n in enumerate(lengths)]
    runs = three_ways(loaded, prompts, 24, stack_calls, max_num_seqs=seqs, **options)
    assert_same_outputs(runs["fused"][0], runs["unfused"][0])
    assert_same_outputs(runs["fused"][0], runs["eager"][0])
    stacked = fuses and fused_built(product) and case != "sinks"
    assert runs["fused"][1] == (3 if fuses and fused_built(product) else 0)
    assert bool(runs["fused"][2]) == stacked and runs["unfused"][2] == runs["eager"][2] == []
    layer_calls: list[int] = []  # the same run, each layer's one call counted (no stack takes them)
    with monkeypatch.context() as patch:
        count_one_calls(patch, "DecodeLayer", layer_calls)
        engine = make_engine(loaded, max_num_seqs=seqs, max_num_batched_tokens=32, **options)
        outputs = run_collecting_logits(engine, prompts, greedy(24, ignore_eos=True))
    assert_same_outputs(outputs, runs["fused"][0])
    assert layer_calls == [rows for rows in runs["fused"][2] for _ in range(3)]
    if case == "more-rows" and stacked:  # the steps of more rows went through the layers' own loop
        assert max(runs["fused"][2]) <= FEW_ROWS


def test_smollm2_defaults_run_every_layer_in_one_call(smollm2, stack_calls):
    ids = smollm2.tokenizer.encode("The cache keeps the keys and values of every token it has seen.")
    runs = three_ways(smollm2, [ids[:n] for n in (4, 11, 7)], 8, stack_calls)
    assert_same_outputs(runs["fused"][0], runs["unfused"][0])
    assert_same_outputs(runs["fused"][0], runs["eager"][0])
    assert bool(runs["fused"][2]) == fused_built("linear_q8")


def test_layers_counted_one_by_one_are_not_stacked(one_calls, stack_calls):
    """A layer whose one call is not layer_ops' own DecodeLayer (here a wrapper that counts it)
    cannot go into a DecodeStack: the model calls its layers one by one."""
    loaded = random_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, seed=9)
    engine = make_engine(loaded, max_num_seqs=2, weight_dtype="int8")
    run_collecting_logits(engine, [[3, 5, 7], [11, 2]], greedy(6, ignore_eos=True))
    assert stack_calls == [] and (one_calls != []) == fused_built("linear_q8")


def test_unstacked_binding_runs_one_call_a_layer(stack_calls):
    """use_fast_path(stacked=False): the layers' one calls bound, the model's stack not."""
    loaded = random_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, seed=9)
    engine = make_engine(loaded, max_num_seqs=2, weight_dtype="int8", enable_prefix_caching=False)
    bound = engine.runner.use_fast_path(True, stacked=False)
    prompts = [[3, 5, 7], [11, 2]]
    unstacked = run_collecting_logits(engine, prompts, greedy(6, ignore_eos=True))
    assert "" not in bound and stack_calls == []
    assert fused_layers(engine) == (2 if fused_built("linear_q8") else 0)
    assert ("" in engine.runner.use_fast_path(True)) == fused_built("linear_q8")
    assert_same_outputs(run_collecting_logits(engine, prompts, greedy(6, ignore_eos=True)), unstacked)
    assert bool(stack_calls) == fused_built("linear_q8")


def test_a_stack_takes_decode_layers_only():
    ops = kernels.load("layer_ops")
    if ops is None or not hasattr(ops, "DecodeStack"):
        pytest.skip("needs the compiled layer_ops kernel")
    with pytest.raises(TypeError, match="DecodeLayer objects, not <class 'int'>"):
        ops.DecodeStack([3])
    with pytest.raises(RuntimeError, match="one DecodeLayer or more"):
        ops.DecodeStack([])


def decode_layers(intermediates, hidden=64, heads=4, kv_heads=2, blocks=12, block_size=16, seed=0,
                  norm_dtype=torch.float32):
    """layer_ops DecodeLayers over linear_q8 products of random Q8_0 weights (one MLP width a
    layer) and each a dense fp32 cache of random K/V, built from the kernels' operations directly."""
    from kvserve.models.packed import FORMATS, quantize
    from tests.conftest import scaled_rows
    ops, q8, attention = kernels.load("layer_ops"), kernels.load("linear_q8"), kernels.load("paged_attention")
    fmt, D = FORMATS["q8_0"], hidden // heads
    g = torch.Generator().manual_seed(seed)

    def product(n, k):
        nonlocal seed
        seed += 1
        p = quantize(scaled_rows(n, k, seed), fmt)
        return q8.rows_op("linear_q8", q8.pack_panels(p.data, fmt.ggml_type, k), fmt.ggml_type, k, n, None)

    layers = []
    for i in intermediates:
        cache = [torch.randn(blocks, block_size, kv_heads, D, generator=g) for _ in range(2)]
        norms = [(1 + 0.1 * torch.randn(hidden, generator=g)).to(norm_dtype) for _ in range(2)]
        qkv, o = product((heads + 2 * kv_heads) * D, hidden), product(hidden, hidden)
        gate_up, down = product(2 * i, hidden), product(hidden, i)
        decode = attention.decode_op("dense", cache, D ** -0.5)
        layers.append(ops.DecodeLayer(norms[0], 1e-5, norms[1], 1e-5, qkv, o, gate_up, down, decode, heads,
                                      kv_heads, "store_kv", cache))
    return layers


def test_a_stack_keeps_its_tensors_between_steps_and_hands_out_its_own_output():
    """DecodeStack's layers write into tensors it keeps, one set for the layers of each shape (two
    MLP widths here), grown to the most rows a step has had: each step (1, 3, then 2 rows) gives
    what the layers' own forwards give one after the other, bit for bit, and an output handed out
    stays as it was through later steps."""
    if not fused_built("linear_q8"):
        pytest.skip("needs the compiled layer_ops (a vector build), paged_attention and linear_q8 kernels")
    ops = kernels.load("layer_ops")
    layers = decode_layers([96, 96, 160, 96])  # two sets, the second's first layer the third
    stack = ops.DecodeStack(layers)
    assert stack.kept_rows == 0
    g = torch.Generator().manual_seed(1)
    tables = torch.arange(12).reshape(3, 4)  # each row's own blocks
    handed = []
    for rows, lens in ((1, [5]), (3, [6, 40, 7]), (2, [8, 41])):
        lens = torch.tensor(lens)
        slots = tables[torch.arange(rows), (lens - 1) // 16] * 16 + (lens - 1) % 16
        angles = torch.rand(rows, 8, generator=g)
        cos, sin = angles.cos(), angles.sin()
        x = torch.randn(rows, 64, generator=g)
        want, residual = layers[0].forward(x.clone(), None, cos, sin, slots, tables[:rows], lens, 0)
        for layer in layers[1:]:
            want, residual = layer.forward(want, residual, cos, sin, slots, tables[:rows], lens, 0)
        got, stream = stack.forward(x, cos, sin, slots, tables[:rows], lens, 0)
        assert torch.equal(got, want) and torch.equal(stream, residual) and stream.data_ptr() == x.data_ptr()
        handed.append((got, got.clone()))
    assert stack.kept_rows == 3
    assert all(torch.equal(out, copy) for out, copy in handed)


def test_a_stack_takes_layers_of_one_hidden_size():
    if not fused_built("linear_q8"):
        pytest.skip("needs the compiled layer_ops (a vector build), paged_attention and linear_q8 kernels")
    layers = decode_layers([96]) + decode_layers([96], hidden=128, heads=8, kv_heads=4)
    with pytest.raises(RuntimeError, match="share one hidden size and dtype, not 64 Float and 128 Float"):
        kernels.load("layer_ops").DecodeStack(layers)
    layers = decode_layers([96]) + decode_layers([96], norm_dtype=torch.float64)
    with pytest.raises(RuntimeError, match="share one hidden size and dtype, not 64 Float and 64 Double"):
        kernels.load("layer_ops").DecodeStack(layers)


@pytest.mark.parametrize("acts", ["float", "int8"])
def test_k_quant_layers_run_in_one_call_too(acts, stack_calls):
    """Q4_K matrices through the stack: linear_kquant's products write into the stack's kept tensors
    (RowsOp::into) and give what the blocks one by one give, bit for bit."""
    if acts == "int8" and kernels.load("linear_kquant") is None:
        pytest.skip(f"int8 activations need the compiled linear_kquant: {kernels.failure('linear_kquant')}")
    runs = three_ways(kquant_llama(), KQUANT_PROMPTS, 10, stack_calls, packed_activations=acts)
    assert_same_outputs(runs["fused"][0], runs["unfused"][0])
    assert_same_outputs(runs["fused"][0], runs["eager"][0])
    assert bool(runs["fused"][2]) == fused_built("linear_kquant")


def test_a_dropped_engine_frees_its_model_and_cache_at_once():
    """The fast path's functions, bound into the model's modules (and the layers' compiled calls,
    which keep the cache's tensors), hold the model in reference cycles; the runner unbinds them
    as it goes, so a dropped engine's model and KV cache are freed at once, with no collection."""
    import gc
    import weakref
    loaded = random_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, seed=9)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        engine = make_engine(loaded, max_num_seqs=2, weight_dtype="int8")
        if not engine.runner.fast_path:
            pytest.skip("nothing binds without the compiled kernels: no cycles to break")
        run_collecting_logits(engine, [[3, 5, 7], [11, 2]], greedy(4, ignore_eos=True))
        model = weakref.ref(engine.model)
        tensors = [t for group in engine.runner.storage.tensors for t in group.values()]
        cache = [weakref.ref(t) for t in tensors + [t._base for t in tensors if t._base is not None]]
        del engine, tensors
        assert model() is None and cache and all(t() is None for t in cache)
    finally:
        if was_enabled:
            gc.enable()


def test_a_runner_unbinds_only_the_fast_path_it_bound():
    """A runner that goes leaves a model another runner bound since as that runner bound it."""
    from kvserve.runner.model_runner import release_fast_path
    loaded = random_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, seed=9)
    engine = make_engine(loaded, max_num_seqs=2, weight_dtype="int8")

    def bound(model):  # the modules whose forward the fast path binds in their instance dict
        return [name for name, m in model.named_modules() if "forward" in m.__dict__]
    before = bound(engine.model)
    if not before:
        pytest.skip("nothing binds without the compiled kernels")
    release_fast_path(engine.model, id(engine.runner) + 1)  # another runner's going
    assert bound(engine.model) == before
    release_fast_path(engine.model, id(engine.runner))
    assert bound(engine.model) == []
