"""The few-row bf16 linear kernel: the same numbers as an fp32-accumulated product rounded to
bf16 once, for 1-8 rows, widths off the vector length, with and without bias; and a bf16 SmolLM2
decoded through it is as close to fp32 as the torch path."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.models import linear
from tests.conftest import greedy, make_engine, run_collecting_logits


@pytest.fixture(scope="module")
def kernel():
    fn = linear.few_row_bf16_kernel()
    if fn is None:
        reason = linear.failure()
        if reason and "AVX512-BF16" in reason:
            pytest.skip(reason)
        pytest.fail(f"the linear kernel did not build: {reason}")
    return fn


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
    torch_path = F.linear(x, w, b).double()
    assert (got == torch_path).float().mean().item() > 0.95


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
def test_smollm2_bf16_decode_through_the_kernel_is_as_close_to_fp32_as_torch(smollm2, kernel):
    """One decode step after each of 8 prompts (4 sequences a step: the kernel's rows), compared
    with fp32 where bf16 and fp32 fed the same token. bf16 greedy paths may part at near-ties,
    so the comparison is of error, not of tokens."""
    ids = smollm2.tokenizer.encode("The cache keeps the keys and values of every token it has seen, so "
                                   "each new token costs a pass over the cache instead of the sequence.")
    prompts = [ids[:n] for n in range(6, 30, 3)]
    runs = {}
    for name, opts in (("fp32", {}), ("torch", dict(dtype="bfloat16", linear_backend="torch")),
                       ("kernel", dict(dtype="bfloat16", linear_backend="cpu-kernel"))):
        engine = make_engine(smollm2, max_model_len=64, max_num_seqs=4, **opts)
        assert (engine.model.lm_head.few_row_kernel is not None) == (name == "kernel")
        out, logits = run_collecting_logits(engine, prompts, greedy(2, ignore_eos=True))
        runs[name] = ([o.outputs[0].token_ids[0] for o in out], [torch.stack(v) for v in logits.values()])
    error = {}
    for name in ("torch", "kernel"):
        same = [i for i, t in enumerate(runs[name][0]) if t == runs["fp32"][0][i]]
        assert len(same) >= 6
        diffs = [(runs[name][1][i][1] - runs["fp32"][1][i][1]).abs() for i in same]
        error[name] = (max(d.max().item() for d in diffs), sum(d.mean().item() for d in diffs) / len(diffs))
    assert error["kernel"][0] < 1.0 and error["kernel"][1] <= 1.2 * error["torch"][1], error
