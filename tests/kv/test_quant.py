"""Round-trip error of every quantized format against bounds derived in fp64: on random tensors,
on tensors with outlier channels and tokens, and on real K/V from SmolLM2."""

import pytest
import torch

from kvserve.kv import quant


def random_kv(seed=0, outliers=True):
    """[blocks=4, bs=16, kvh=3, hd=64], with a few channels and tokens 20x larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, 3, 64, generator=g)
    if outliers:
        x[..., [5, 40]] *= 20  # outlier channels (keys have them)
        x[:, 3] *= 20  # an outlier token (values have them)
    return x


def test_int8_error_is_at_most_half_a_step():
    x = random_kv().double()
    q, scale = quant.quantize_int8(x)
    err = (quant.dequantize_int8(q, scale).double() - x).abs()
    step = x.abs().amax(-1, keepdim=True) / 127
    assert (err <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]


@pytest.mark.parametrize("dim", [-3, -1], ids=["keys-per-channel", "values-per-token"])
def test_int4_error_is_half_a_step_plus_fp16_rounding(dim):
    x = random_kv().double()
    packed, scale, zero = quant.quantize_int4(x, dim)
    assert packed.shape[-1] == 32 and packed.dtype == torch.uint8
    err = (quant.dequantize_int4(packed, scale, zero, dim).double() - x).abs()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    exact = (hi - lo) / 15
    s, z = scale.double().unsqueeze(dim), zero.double().unsqueeze(dim)
    bound = s / 2 + (z - lo).abs() + 15 * (s - exact).abs()  # the stored scale and zero are fp16
    assert (err <= bound * (1 + 1e-6) + 1e-6).all()


def test_int4_packs_channel_c_with_channel_c_plus_half():
    x = torch.arange(16.0).repeat(2, 1).view(1, 1, 32)  # channels 0..15 then 0..15 again: one step each
    packed, _, _ = quant.quantize_int4(x, -1)
    assert (quant.unpack_int4(packed) == torch.cat([torch.arange(16), torch.arange(16)]).to(torch.uint8)).all()
    assert packed[0, 0, 3].item() == 3 | (3 << 4)


@pytest.mark.parametrize("name, mantissa, min_exp", [("fp8_e4m3", 3, -6), ("fp8_e5m2", 2, -14)])
def test_fp8_relative_error_and_saturation(name, mantissa, min_exp):
    x = random_kv(outliers=False).double().view(-1, 3, 64)
    scale = torch.tensor([0.01, 0.02, 0.05], dtype=torch.float64)
    codes = quant.quantize_fp8(x, scale.float(), name)
    back = quant.dequantize_fp8(codes, scale.float(), name).double()
    y = x / scale.view(1, 3, 1)
    # rounding to `mantissa` bits: half an ulp relative, or half the smallest subnormal absolute
    bound = torch.maximum(y.abs() * 2.0 ** -(mantissa + 1), torch.full_like(y, 2.0 ** (min_exp - mantissa - 1)))
    assert ((back - x).abs() <= bound * scale.view(1, 3, 1) * (1 + 1e-6)).all()
    limit = torch.finfo(quant.FP8_DTYPES[name]).max
    huge = torch.full((1, 3, 64), 1e6)
    assert torch.allclose(quant.dequantize_fp8(quant.quantize_fp8(huge, scale.float(), name), scale.float(), name),
                          (limit * scale).float().view(1, 3, 1).expand(1, 3, 64))


def test_fp8_table_is_every_code():
    for name in quant.FP8_DTYPES:
        table = quant.fp8_table(name)
        codes = torch.arange(256, dtype=torch.uint8)
        finite = torch.isfinite(codes.view(quant.FP8_DTYPES[name]).float())
        assert torch.equal(table[finite], codes.view(quant.FP8_DTYPES[name]).float()[finite])


@pytest.fixture(scope="module")
def smollm2_kv(smollm2):
    """K and V of every layer of SmolLM2 over a real prompt, [layers, T, kvh, hd]."""
    from kvserve.engine.calibrate import CALIBRATION_TEXT, _RecordingBackend
    from tests.conftest import make_engine
    engine = make_engine(smollm2, max_model_len=512, exact=True)
    seen = {"k": [], "v": []}

    class Keep(_RecordingBackend):
        def forward(self, layer, q, k, v, storage, meta, scale, softcap=None):
            seen["k"].append(k.clone())
            seen["v"].append(v.clone())
            return super().forward(layer, q, k, v, storage, meta, scale, softcap)

    from kvserve.attention.backend import AttentionMetadata, PrefillSpan
    from kvserve.attention.layer import ForwardContext, install
    c = smollm2.config
    backend = Keep(c.num_hidden_layers, c.num_key_value_heads, torch.float32)
    install(engine.model, backend, [0] * c.num_hidden_layers)
    ids = smollm2.tokenizer.encode(CALIBRATION_TEXT)[:160]
    meta = backend.build_metadata(AttentionMetadata(prefills=[PrefillSpan(0, len(ids), len(ids))]), None)
    engine.model(torch.tensor(ids), torch.arange(len(ids)), ForwardContext(None, [meta]))
    return torch.stack(seen["k"]), torch.stack(seen["v"])


def relative_error(x, y):
    return ((x - y).norm() / x.norm()).item()


@pytest.mark.slow
def test_real_kv_round_trips_within_each_formats_error(smollm2_kv):
    k, v = smollm2_kv
    L, T = k.shape[:2]
    blocks = lambda x: x[:, :T // 16 * 16].reshape(L, -1, 16, *x.shape[2:])  # noqa: E731
    errors = {}
    for name, x in (("k", k), ("v", v)):
        errors[("int8", name)] = relative_error(x, quant.dequantize_int8(*quant.quantize_int8(x)))
        xb = blocks(x)
        dim = -3 if name == "k" else -1
        errors[("int4", name)] = relative_error(xb, quant.dequantize_int4(*quant.quantize_int4(xb, dim), dim))
        amax = x.abs().amax(dim=(1, 3))  # [layers, kvh]
        for fmt in quant.FP8_DTYPES:
            scale = amax * 2 / torch.finfo(quant.FP8_DTYPES[fmt]).max
            per_layer = [quant.dequantize_fp8(quant.quantize_fp8(x[i], scale[i], fmt), scale[i], fmt) for i in range(L)]
            errors[(fmt, name)] = relative_error(x, torch.stack(per_layer))
    print({f"{a}/{b}": round(e, 4) for (a, b), e in errors.items()})
    # measured here (relative L2 error, keys / values): int8 1.1% / 0.7% (per-token scales suffer
    # from the keys' outlier channels), e4m3 2.6% / 2.7% (3 mantissa bits), e5m2 5.3% / 5.3% (2),
    # int4 3.1% / 9.6% (per-channel keys absorb the outliers); the bounds leave about 1.5x
    limits = {"int8": (0.017, 0.011), "fp8_e4m3": (0.04, 0.04), "fp8_e5m2": (0.08, 0.08), "int4": (0.05, 0.15)}
    assert all(e < limits[fmt][name == "v"] for (fmt, name), e in errors.items()), errors


@pytest.mark.slow
def test_real_keys_have_outlier_channels_that_per_channel_int4_absorbs(smollm2_kv):
    """KIVI's reason: SmolLM2's keys have a few channels far larger than the rest, so quantizing
    a key block per channel loses less than quantizing each token over its channels; values have
    no such channels and are quantized per token."""
    k, _ = smollm2_kv
    L, T = k.shape[:2]
    channel_size = k.abs().amax(dim=(1,))  # [layers, kvh, hd]
    assert (channel_size.amax(-1) / channel_size.median(-1).values).median() > 4  # outlier channels
    kb = k[:, :T // 16 * 16].reshape(L, -1, 16, *k.shape[2:])
    per_channel = relative_error(kb, quant.dequantize_int4(*quant.quantize_int4(kb, -3), -3))
    per_token = relative_error(kb, quant.dequantize_int4(*quant.quantize_int4(kb, -1), -1))
    assert per_channel < 0.7 * per_token, (per_channel, per_token)
