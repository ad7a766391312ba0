"""The latent (MLA) storage: bytes per block by the one formula, checked against the tensors it
allocates; rows read back as written (the latent as the value, a view of the key); blocks
copied, swapped and gathered through any block table; int8 and fp8 latents within their
measured error; DeepSeek's published shapes costed."""

import pytest
import torch

from kvserve.config import CacheConfig, MLAConfig, ModelConfig
from kvserve.kv.formats import kv_format, mha_bytes_per_token
from kvserve.kv.latent import LatentKVStorage, QuantLatentKVStorage, make_latent_storage
from kvserve.kv.sizing import plan_cache

RANK, ROPE, BS, LAYERS = 32, 8, 4, 3
MLA = MLAConfig(RANK, 16, ROPE, 12)
MODEL = ModelConfig(128, 64, 96, LAYERS, 4, 4, 24, 256, mla=MLA)


def allocated_bytes(storage):
    return sum(t.numel() * t.element_size() for tensors in storage.tensors for t in tensors.values())


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_bytes_per_block_by_formula_equal_the_tensors(fmt):
    f = kv_format(fmt)
    storage = make_latent_storage(f.kind, f.name, list(range(LAYERS)), 10, BS, RANK, ROPE, "cpu")
    scales = 2 * 4 if f.kind in ("int8", "fp8") else 0  # a fp32 scale for the latent, one for the rotary key
    formula = LAYERS * BS * ((RANK + ROPE) * f.bits // 8 + scales)
    assert storage.bytes_per_block == formula == allocated_bytes(storage) // 10
    assert f.bytes_per_token(MODEL, BS) * BS == formula
    plan = plan_cache(CacheConfig(block_size=BS, num_blocks=9), MODEL, fmt, 64, 4, "cpu")
    assert plan.block_bytes == formula and plan.total_bytes == storage.nbytes


def test_rows_read_back_and_blocks_move():
    storage = LatentKVStorage([0, 1], 6, BS, RANK, ROPE, torch.float32, "cpu")
    rows = torch.randn(10, 1, RANK + ROPE)
    slots = torch.tensor([4 * BS + i for i in range(4)] + [1 * BS + i for i in range(4)] + [3 * BS, 3 * BS + 1])
    storage.write(1, rows, rows[..., :RANK], slots)
    keys, values = storage.gather(1, torch.tensor([[4, 1, 3]]), BS)
    assert torch.equal(keys[0, :10], rows) and torch.equal(values[0, :10], rows[..., :RANK])
    assert values.data_ptr() == keys.data_ptr()  # the value is the latent part of the key, not a copy
    assert not storage.gather(0, torch.tensor([[4]]), BS)[0].any()  # the other layer untouched

    storage.copy_blocks([(4, 0)])  # copy on write
    assert torch.equal(storage.gather(1, torch.tensor([[0]]), BS)[0][0], rows[:4])
    cpu = LatentKVStorage([0, 1], 3, BS, RANK, ROPE, torch.float32, "cpu")
    storage.swap_out(cpu, [(1, 2)])
    storage.copy_blocks([(5, 1)])  # the block is reused meanwhile
    storage.swap_in(cpu, [(2, 1)])
    assert torch.equal(storage.gather(1, torch.tensor([[1]]), BS)[0][0], rows[4:8])


def test_a_row_of_the_wrong_shape_is_refused():
    storage = LatentKVStorage([0], 2, BS, RANK, ROPE, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"\[T, 1, 40\]"):
        storage.write(0, torch.randn(2, 4, RANK + ROPE), None, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="no latent"):
        make_latent_storage("int4", "int4", [0], 2, BS, RANK, ROPE, "cpu")


@pytest.mark.parametrize("fmt, bound", [("int8", 0.01), ("fp8_e4m3", 0.07), ("fp8_e5m2", 0.13)])
def test_quantized_latents_error_measured(fmt, bound):
    """Relative error per row, the latent and the rotary key each against its own amax; the rotary
    key is 10x the latent's scale and keeps its own precision."""
    storage = make_latent_storage(kv_format(fmt).kind, fmt, [0], 4, BS, RANK, ROPE, "cpu")
    assert isinstance(storage, QuantLatentKVStorage) and not storage.reads_back_exactly(torch.float32)
    rows = torch.randn(8, 1, RANK + ROPE, generator=torch.Generator().manual_seed(0))
    rows[..., RANK:] *= 10
    storage.write(0, rows, rows[..., :RANK], torch.arange(8))
    keys, values = storage.gather(0, torch.tensor([[0, 1]]), BS)
    for part in (slice(0, RANK), slice(RANK, None)):
        err = ((keys[0, :, :, part] - rows[..., part]).abs().amax(-1) / rows[..., part].abs().amax(-1)).max().item()
        print(f"{fmt}: max error relative to the row's amax {err:.4f}")
        assert 0 < err < bound
    assert torch.equal(values, keys[..., :RANK])


def test_deepseek_v2_costs_60_layers_of_576_values():
    from kvserve.models.registry import KNOWN_CONFIGS
    v2 = KNOWN_CONFIGS["deepseek-v2"]
    assert kv_format("bfloat16").bytes_per_token(v2) == 60 * (512 + 64) * 2
    # the same 128 heads as MHA: K (128 + 64) and V (128) per head
    assert mha_bytes_per_token(kv_format("bfloat16"), v2) == 60 * 128 * (192 + 128) * 2
    assert kv_format("bfloat16").bytes_per_token(KNOWN_CONFIGS["deepseek-v2-lite"]) == 27 * 576 * 2
    assert kv_format("bfloat16").bytes_per_token(KNOWN_CONFIGS["deepseek-v3"]) == 61 * 576 * 2


def test_memory_report_sets_the_latent_beside_gqa_and_mha(capsys):
    from kvserve.cli import main, memory_report
    r = memory_report("deepseek-v2", 4096, 1, "bfloat16", 16)
    assert r["attention"] == "MLA (latent)" and r["bytes_per_token"] == 60 * 576 * 2
    assert r["mla"]["gqa_bytes_per_token"] == 60 * 8 * (192 + 128) * 2
    assert r["mha_bytes_per_token"] == 60 * 128 * (192 + 128) * 2
    assert main(["memory", "--model", "deepseek-v2", "--kv-cache-dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "60 x (512 latent + 64 rotary key) x 16/8 = 69,120 bytes" in out and "GQA with 8 KV heads" in out


def test_a_float_latent_cache_reads_back_the_cast_of_its_rows():
    """A bf16 latent cache gives back exactly its cast of the fp32 rows written, so a chunk that
    starts its sequence may attend to its fresh rows so cast (reads_back_as); quantized latents
    give back something else and say so."""
    storage = LatentKVStorage([0], 2, BS, RANK, ROPE, torch.bfloat16, "cpu")
    assert storage.reads_back_as() == torch.bfloat16 and storage.reads_back_exactly(torch.bfloat16)
    assert not storage.reads_back_exactly(torch.float32)
    rows = torch.randn(BS + 3, 1, RANK + ROPE, generator=torch.Generator().manual_seed(1))
    storage.write(0, rows, rows[..., :RANK], torch.arange(BS + 3))
    keys, values = storage.gather(0, torch.tensor([[0, 1]]), BS)
    assert torch.equal(keys[0, :BS + 3], rows.to(torch.bfloat16))
    assert torch.equal(values[0, :BS + 3], rows[..., :RANK].to(torch.bfloat16))
    for fmt in ("int8", "fp8_e4m3"):
        quantized = make_latent_storage(kv_format(fmt).kind, fmt, [0], 2, BS, RANK, ROPE, "cpu")
        assert quantized.reads_back_as() is None
