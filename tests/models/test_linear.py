"""The few-row bf16 linear kernel, on every code path this CPU runs (the portable one everywhere):
within one bf16 step of the exact product, for 1-8 rows, widths off the vector length, with and
without bias; and a bf16 SmolLM2 decoded through it is as accurate as exact products rounded once."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.models import linear
from tests.conftest import compiled_kernel, greedy, kernel_isas, make_engine, run_collecting_logits


@pytest.fixture(scope="module", params=kernel_isas("linear_bf16"))
def kernel(request):
    module = compiled_kernel("linear_bf16", request.param)
    assert module.isa() == request.param
    return module.linear_bf16


def exact_rounded_once(x, w, b):
    """The reference product: exact (fp64) sums of bf16 products, rounded to bf16 once."""
    return F.linear(x.double(), w.double(), None if b is None else b.double()).to(torch.bfloat16)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("k, n, bias", [(576, 192, False), (100, 77, True), (31, 5, False), (1536, 576, True)])
def test_kernel_is_an_fp32_accumulated_product_rounded_once(kernel, rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = kernel(x, w, b).double()
    # fp32 sums in another order may land on the neighbouring bf16 number, never further
    assert ((got - exact).abs() <= bf16_ulp(exact) + 1e-6).all()
    # and lands on the exact product rounded once almost everywhere
    assert (got == exact_rounded_once(x, w, b).double()).float().mean().item() > 0.95


def test_kernel_reads_a_transposed_view_of_x(kernel):
    x = torch.randn(64, 3).bfloat16().t()  # [3, 64], not contiguous
    w = torch.randn(40, 64).bfloat16()
    assert torch.equal(kernel(x, w, None), kernel(x.contiguous(), w, None))


def test_kernel_rejects_what_it_does_not_do(kernel):
    w = torch.randn(8, 32).bfloat16()
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        kernel(torch.randn(9, 32).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="bf16"):
        kernel(torch.randn(1, 32), w.float(), None)


def test_linear_module_uses_the_kernel_only_for_few_bf16_rows(kernel, monkeypatch):
    layer = linear.Linear(64, 32).bfloat16()
    calls = []
    linear.use_few_row_kernel(layer, lambda x, w, b: calls.append(x.shape[0]) or kernel(x, w, b))
    layer(torch.randn(linear.FEW_ROWS, 64).bfloat16())
    layer(torch.randn(linear.FEW_ROWS + 1, 64).bfloat16())
    layer.float()(torch.randn(1, 64))
    assert calls == [linear.FEW_ROWS]


@pytest.mark.slow
def test_smollm2_bf16_decode_through_the_kernel_is_as_accurate_as_exact_products(smollm2, kernel):
    """A bf16 SmolLM2 decoding 4 sequences a step (the kernel's rows) through the kernel is as
    close to the fp32 model as the same bf16 model whose few-row products are exact and rounded
    once. Both references are fp32/fp64 math, so the bound holds on any CPU; only the linear
    layers differ between the two bf16 runs."""
    ids = smollm2.tokenizer.encode("The cache keeps the keys and values of every token it has seen, so "
                                   "each new token costs a pass over the cache instead of the sequence.")
    prompts = [ids[:n] for n in range(6, 30, 3)]
    runs = {}
    for name, fn in (("fp32", None), ("exact", exact_rounded_once), ("kernel", kernel)):
        engine = make_engine(smollm2, max_model_len=64, max_num_seqs=4,  # packed products in float, as the fp32 path
                             **(dict(exact=True) if fn is None else dict(dtype="bfloat16", linear_backend="torch",
                                                                         packed_activations="float")))
        if fn is not None:
            linear.use_few_row_kernel(engine.model, fn)
        out, logits = run_collecting_logits(engine, prompts, greedy(4, ignore_eos=True))
        runs[name] = ([o.outputs[0].token_ids for o in out], [torch.stack(v) for v in logits.values()])
    error = {}
    for name in ("exact", "kernel"):
        assert runs[name][0] == runs["fp32"][0]  # no near-tie among these prompts
        diffs = [(a - b).abs() for a, b in zip(runs[name][1], runs["fp32"][1])]
        error[name] = (max(d.max().item() for d in diffs), sum(d.mean().item() for d in diffs) / len(diffs))
    assert error["kernel"][1] <= 1.25 * error["exact"][1] and error["kernel"][0] <= 1.5 * error["exact"][0], error


onednn = pytest.mark.skipif(not linear.onednn_available(), reason="this PyTorch has no oneDNN prepacked linear")
onednn_bf16 = pytest.mark.skipif(not (linear.onednn_available() and linear.onednn_bf16_supported()),
                                 reason="oneDNN runs no bf16 products on this CPU (it needs AVX512 BW/VL/DQ)")


@onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 64, 200])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=onednn_bf16), torch.float32])
def test_reordered_weight_gives_the_stock_product(rows, bias, dtype):
    """use_onednn changes where the weight lives, not the arithmetic: the product is within
    rounding of the exact one (fp64), whatever GEMM oneDNN picks on this CPU. bf16 rounds the
    fp32 sum once and the bias add once more (2 x 2^-8 relative); fp32 sums in float."""
    g = torch.Generator().manual_seed(rows)
    layer = linear.Linear(100, 77, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(77, 100, generator=g))
    w, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    assert linear.use_onednn(layer) == 1
    assert layer.weight.numel() == 0  # the reordered copy replaces the plain one
    x = torch.randn(rows, 100, generator=g).to(dtype)
    got = layer(x)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    size = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    relative = 2 * 2.0 ** -8 + 1e-5 if dtype == torch.bfloat16 else 1e-5
    assert ((got.double() - exact).abs() <= relative * size + 1e-5).all()
    # leading dimensions are kept (rows flattened: the stock 3-D product adds its bias apart)
    assert torch.equal(layer(x.view(1, rows, 100)), got.view(1, rows, 77))


@onednn
def test_a_shared_weight_stays_plain():
    """A head tied to the embedding keeps its plain weight (the embedding reads it), so the
    model's weights take no more memory than before."""
    emb, head, other = torch.nn.Embedding(50, 16), linear.Linear(16, 50, bias=False), linear.Linear(16, 16)
    model = torch.nn.ModuleList([emb, head, other])
    head.weight = emb.weight
    assert linear.use_onednn(model) == 1
    assert head.onednn_weight is None and head.weight is emb.weight and other.onednn_weight is not None
    assert linear.use_onednn(model) == 0  # once


@onednn
def test_bf16_weights_stay_plain_where_onednn_has_no_bf16(monkeypatch):
    """On a CPU where oneDNN refuses bf16 (AVX2 only) the bf16 weights keep their plain layout
    and the stock product; fp32 weights are reordered all the same."""
    monkeypatch.setattr(linear, "onednn_bf16_supported", lambda: False)
    half, full = linear.Linear(32, 16).bfloat16(), linear.Linear(32, 16)
    assert linear.use_onednn(torch.nn.ModuleList([half, full])) == 1
    assert half.onednn_weight is None and half.weight.shape == (16, 32) and full.onednn_weight is not None
    x = torch.randn(3, 32).bfloat16()
    assert torch.equal(half(x), torch.nn.functional.linear(x, half.weight, half.bias))


@onednn_bf16
@pytest.mark.slow
def test_bf16_engine_through_reordered_weights_is_as_accurate_as_the_stock_gemm(smollm2):
    """A bf16 SmolLM2 whose layers' weights are reordered for oneDNN (linear backend auto) is as
    close to the fp32 model as the stock F.linear bf16 engine, prompts and decode steps alike (the
    tied head, plain in both, takes the few-row kernel in both). The reference is fp32 math, so
    the bound holds whichever GEMM oneDNN picks on this CPU."""
    ids = smollm2.tokenizer.encode("A paged cache hands out fixed-size blocks as sequences grow.")
    prompts = [ids[:n] for n in range(5, 15)]
    runs = {}
    for backend in ("fp32", "auto", "torch"):
        bf16 = dict(exact=True) if backend == "fp32" else dict(dtype="bfloat16", weight_dtype="bfloat16",
                                                               linear_backend=backend)
        engine = make_engine(smollm2, max_model_len=64, max_num_seqs=8, **bf16)
        reordered = [m for m in engine.model.modules() if isinstance(m, linear.Linear) and m.onednn_weight is not None]
        if backend != "fp32":
            assert len(reordered) == (7 * smollm2.config.num_hidden_layers if backend == "auto" else 0)
            engine.model.lm_head.few_row_kernel = linear.kernel_for("auto")
        out, logits = run_collecting_logits(engine, prompts, greedy(6, ignore_eos=True))
        runs[backend] = ([o.outputs[0].token_ids for o in out], [torch.stack(v) for v in logits.values()])
    assert runs["auto"][0] == runs["torch"][0]
    error = {}
    for name in ("auto", "torch"):
        diffs = [(a - b).abs() for a, b in zip(runs[name][1], runs["fp32"][1])]
        error[name] = (max(d.max().item() for d in diffs), sum(d.mean().item() for d in diffs) / len(diffs))
    assert error["auto"][1] <= 1.25 * error["torch"][1] and error["auto"][0] <= 1.5 * error["torch"][0], error
