"""The product policy (kvserve.models.products): the path its rule names for each row count, and
the module the engine builds taking that path, shown by counting the calls each kernel gets
through the module's own kernel object (not by timing)."""

import pytest
import torch

from kvserve import kernels
from kvserve.models.packed import PackedLinearQ8
from kvserve.models.products import (AMX_POLICY, AVX512_BF16_POLICY, DENSE_COPY_EXPANSION, EXACT_POLICY,
                                     INT8_POLICY, DenseAbove, ProductPolicy, dense_copy_budget, int8_kernel,
                                     keep_dense_copies, make_dense_copies, missing_int8_kernels,
                                     packed_formats, policy_for)
from kvserve.modules import FastPath
from kvserve.models import products
from kvserve.models import linear as linear_module
from tests.conftest import make_engine

ROWS = (1, 4, 16, 64, 256, 512)


class Counting:
    """A kernel module whose calls are counted by name, each passed on to the real one."""

    def __init__(self, module):
        self.module, self.calls = module, {}

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted


def test_the_policy_names_its_rule_for_each_row_count():
    assert [AMX_POLICY.path(r, "linear_q8") for r in ROWS] == ["int8"] * 4 + ["dense"] * 2  # above 64
    # made in AMX tiles from the packed weight: above 24 rows
    assert [AMX_POLICY.path(r, "linear_q8", tiles=True) for r in ROWS] == ["int8"] * 3 + ["dense"] * 3
    assert AMX_POLICY.threshold("linear_kquant", tiles=True) == 8  # no tiles named: the copy's rows
    assert INT8_POLICY.threshold("linear_q8", tiles=True) is None
    assert [AMX_POLICY.path(r, "linear_kquant") for r in ROWS] == ["int8"] * 2 + ["dense"] * 4  # above 8
    # AVX512-BF16 without AMX: VNNI's int8 beats the bf16 copy for Q4_0 / Q4_1 / Q8_0 at every row count
    assert [AVX512_BF16_POLICY.path(r, "linear_q8") for r in ROWS] == ["int8"] * len(ROWS)
    assert AVX512_BF16_POLICY.threshold("linear_q8", tiles=True) is None
    assert [AVX512_BF16_POLICY.path(r, "linear_kquant") for r in ROWS] == ["int8"] * 2 + ["dense"] * 4
    assert [INT8_POLICY.path(r, k) for r in ROWS for k in ("linear_q8", "linear_kquant")] == ["int8"] * 12
    assert [EXACT_POLICY.path(r) for r in ROWS] == ["float"] * len(ROWS)


def test_the_defaults_policy_follows_the_cpus_matrix_unit():
    sapphire_rapids = frozenset({"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"})
    zen4 = frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})
    zen3 = frozenset({"avx2", "fma"})
    assert policy_for("int8", 0.25, sapphire_rapids) is AMX_POLICY
    assert policy_for("int8", 0.25, zen4) is AVX512_BF16_POLICY
    assert policy_for("int8", 0.25, zen3) is INT8_POLICY
    assert all(policy_for("int8", 0.0, flags) is INT8_POLICY for flags in (sapphire_rapids, zen4, zen3))
    assert all(policy_for("float", 0.25, flags) is EXACT_POLICY for flags in (sapphire_rapids, zen4, zen3))
    assert policy_for("int8", 0.25) is policy_for("int8", 0.25, kernels.cpu_flags())  # this CPU's
    assert AMX_POLICY.keeps_copies(frozenset({"amx_bf16"})) and not AMX_POLICY.keeps_copies(zen4)
    assert AVX512_BF16_POLICY.keeps_copies(zen4) and not AVX512_BF16_POLICY.keeps_copies(zen3)
    assert not INT8_POLICY.keeps_copies(frozenset({"amx_bf16"}))
    with pytest.raises(ValueError, match="policy activations must be int8 or float, got 'int4'"):
        ProductPolicy("int4")
    with pytest.raises(ValueError, match="dense_above_rows of linear_q8 must be >= 0"):
        ProductPolicy("int8", dense_above_rows=(("linear_q8", -1),))


def test_the_copies_budget():
    assert dense_copy_budget(66_000_000, 0.25, 10**9) == 250_000_000  # a quarter of available memory
    assert dense_copy_budget(66_000_000, 0.25, 10**12) == 66_000_000 * DENSE_COPY_EXPANSION  # the expansion
    assert dense_copy_budget(66_000_000, 0.0, 10**12) == 0


def test_int8_kernels_and_formats(smollm2, stories):
    assert int8_kernel("q4_1") == int8_kernel("q8_0") == "linear_q8"
    assert int8_kernel("q4_k") == int8_kernel("q5_0") == "linear_kquant"
    assert packed_formats(smollm2) == {"q4_1", "q8_0"}
    assert packed_formats(smollm2, "float32") == set()
    assert packed_formats(stories) == set() and packed_formats(stories, "int4") == {"q4_1"}
    built = kernels.load("linear_q8") is not None
    assert missing_int8_kernels({"q4_1"}) == ([] if built else ["linear_q8"])


def count_calls(linear, rows):
    """Calls of the int8 kernel, the float kernel and the dense copy as `linear` multiplies
    `rows` rows through its eager forward (the fast forms bound the kernels before they were
    counted); the output's shape checked."""
    dense = linear if isinstance(linear, DenseAbove) else None
    packed = dense.packed if dense is not None else linear
    int8 = Counting(packed.q8) if isinstance(packed, PackedLinearQ8) else None
    flt = Counting(packed.kernel)
    copy = Counting(dense) if dense is not None else None
    if int8 is not None:
        packed.q8 = int8
    packed.kernel = flt
    if copy is not None:
        dense._dense = copy._dense
    try:
        with torch.no_grad():
            y = linear(torch.randn(rows, linear.in_features))
    finally:
        if int8 is not None:
            packed.q8 = int8.module
        packed.kernel = flt.module
        if copy is not None:
            del dense._dense
    assert y.shape == (rows, linear.out_features)
    return (int8.calls.get("linear_q8", 0) if int8 else 0), sum(flt.calls.values()), \
        (copy.calls.get("_dense", 0) if copy else 0)


def unbind(module):
    for m in module.modules():
        if isinstance(m, FastPath):
            m.unbind()


def test_the_defaults_take_the_policys_path_at_every_row_count(smollm2):
    if kernels.load("linear_q8") is None:
        pytest.skip("the int8 kernel is not built here")
    engine = make_engine(smollm2, max_model_len=256)
    policy = policy_for(engine.config.packed_activations, engine.config.dense_copy_memory)
    assert policy is policy_for("int8", 0.25, kernels.cpu_flags())
    linear = engine.model.model.layers[0].mlp.down_proj
    copies = (policy.keeps_copies(kernels.cpu_flags()) and linear_module.onednn_bf16_supported()
              and policy.threshold("linear_q8") is not None)  # without AMX: int8 at every row count
    assert isinstance(linear, DenseAbove) == copies
    with torch.no_grad():  # the runner's bound form takes the same path as the eager one
        fast = {rows: linear(x) for rows, x in ((r, torch.randn(r, linear.in_features)) for r in (16, 128))}
    unbind(linear)
    for rows in ROWS:
        int8_calls, float_calls, dense_calls = count_calls(linear, rows)
        if copies and policy.path(rows, "linear_q8", linear.tiles is not None) == "dense":
            assert (int8_calls, float_calls, dense_calls) == (0, 0, 1), rows
        else:
            assert (int8_calls, float_calls, dense_calls) == (1, 0, 0), rows
    assert fast[16].shape == (16, linear.out_features)


def test_the_bound_and_eager_forms_agree(smollm2, q8_copies):
    if kernels.load("linear_q8") is None or not linear_module.onednn_bf16_supported():
        pytest.skip("no int8 kernel or no oneDNN bf16 here")
    engine = make_engine(smollm2, max_model_len=256)
    linear = engine.model.model.layers[0].mlp.down_proj
    xs = [torch.randn(r, linear.in_features) for r in (3, 64, 65, 300)]
    with torch.no_grad():
        fast = [linear(x) for x in xs]
        unbind(linear)
        eager = [linear(x) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(fast, eager))


@pytest.fixture
def copies_not_tiles(monkeypatch):
    """The bf16 copies even where the AMX build would make the copy's product from the packed
    weight (bf16_tiles): the copy path is shown on every machine."""
    monkeypatch.setattr(products, "bf16_tiles", lambda packed, dtype: None)


def test_a_dense_copy_is_made_by_the_first_call_above_the_threshold(smollm2, copies_not_tiles, q8_copies):
    """No copy at load; calls of up to 64 rows make none; the first larger call makes it, equal to
    one made ahead by make_dense_copies (the server's start)."""
    if kernels.load("linear_q8") is None or not linear_module.onednn_bf16_supported():
        pytest.skip("no int8 kernel or no oneDNN bf16 here")
    lazy, ahead = make_engine(smollm2, max_model_len=256), make_engine(smollm2, max_model_len=256)
    copies = [m for m in lazy.model.modules() if isinstance(m, DenseAbove)]
    assert copies and all(m.dense_weight is None for m in copies)
    assert make_dense_copies(ahead.model) == sum(m.dense_bytes for m in copies) > 0
    linear, made = lazy.model.model.layers[0].mlp.down_proj, ahead.model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        linear(torch.randn(64, linear.in_features))
        assert linear.dense_weight is None
        x = torch.randn(65, linear.in_features)
        assert torch.equal(linear(x), made(x)) and linear.dense_weight is not None
    assert all(m.dense_weight is None for m in copies if m is not linear)


@pytest.mark.parametrize("options, path", [(dict(exact=True), "float"), (dict(packed_activations="int8"), "int8")])
def test_a_named_path_takes_every_row_count(smollm2, options, path):
    if kernels.load("linear_q8") is None:
        pytest.skip("the int8 kernel is not built here")
    engine = make_engine(smollm2, max_model_len=256, **options)
    linear = engine.model.model.layers[0].mlp.down_proj
    assert not any(isinstance(m, DenseAbove) for m in engine.model.modules())
    unbind(linear)
    for rows in ROWS:
        int8_calls, float_calls, dense_calls = count_calls(linear, rows)
        # float: up to 8 rows the float kernel's product; beyond, the weight dequantized by it once
        assert (int8_calls, float_calls, dense_calls) == ((1, 0, 0) if path == "int8" else (0, 1, 0)), rows


def test_copies_stay_within_the_budget(smollm2, copies_not_tiles):
    if kernels.load("linear_q8") is None or not linear_module.onednn_bf16_supported():
        pytest.skip("no int8 kernel or no oneDNN bf16 here")
    engine = make_engine(smollm2, max_model_len=256, packed_activations="int8")
    one_layer = sum(m.out_features * m.in_features * 2 for m in engine.model.model.layers[0].modules()
                    if isinstance(m, PackedLinearQ8))
    kept = keep_dense_copies(engine.model, AMX_POLICY, one_layer)
    copies = [m for m in engine.model.modules() if isinstance(m, DenseAbove)]
    assert 0 < kept <= one_layer and sum(m.dense_bytes for m in copies) == kept
    assert not isinstance(engine.model.lm_head, DenseAbove)  # the head multiplies only the sampled rows


def test_amx_tiles_multiply_what_a_copy_would_and_hold_no_copy(smollm2):
    """Where the AMX build makes the bf16 product from the packed weight at each call, the
    defaults' dense path holds no copy (no bytes, none made ahead or by a call) and gives the
    bf16 copy's product: bf16(x) times the weight dequantized and rounded to bf16, up to the
    order of the fp32 sums."""
    if kernels.load("linear_q8") is None:
        pytest.skip(f"the int8 kernel is not loaded here: {kernels.failure('linear_q8')}")
    if not hasattr(kernels.load("linear_q8"), "linear_bf16_tiles"):
        pytest.skip("no AMX build of linear_q8 here (amx_tile, amx_int8, amx_bf16)")
    engine = make_engine(smollm2, max_model_len=256)
    dense = [m for m in engine.model.modules() if isinstance(m, DenseAbove)]
    assert dense and all(m.tiles is not None and m.dense_bytes == 0 for m in dense)
    assert make_dense_copies(engine.model) == 0
    for linear in (engine.model.model.layers[0].mlp.down_proj, engine.model.model.layers[0].self_attn.fused_qkv.fused):
        x = torch.randn(linear.threshold + 9, linear.in_features)
        with torch.no_grad():
            y = linear(x)
        assert linear.dense_weight is None
        xb, w = x.bfloat16().double(), linear.packed._dense_weight(torch.bfloat16).double()
        bound = linear.in_features * 2 ** -23 * (xb.abs() @ w.abs().T) + 1e-30
        assert ((y.double() - xb @ w.T).abs() <= bound).all()
