"""Loaders on real files: known greedy outputs, tokenizers against references, clear errors."""

import os
import struct

import pytest
import torch

from kvserve.models.loaders.base import ModelLoadError, interleaved_to_half_rope
from kvserve.models.registry import load_weights, read_model_config
from tests.conftest import STORIES_GOLDEN, greedy, make_llm


def test_stories260k_greedy_golden(stories):
    cfg = stories.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (5, 8, 4)
    out = make_llm(stories).generate(["Once upon a time"], greedy(40))[0]
    full = "Once upon a time" + out.outputs[0].text
    assert full.startswith(STORIES_GOLDEN), full


def test_stories260k_loads_from_file_and_directory(stories_path):
    a = load_weights(os.path.join(stories_path, "stories260K.bin"))
    b = load_weights(stories_path)
    assert a.tokenizer is not None and b.tokenizer is not None
    assert torch.equal(a.state_dict["model.layers.0.self_attn.q_proj.weight"],
                       b.state_dict["model.layers.0.self_attn.q_proj.weight"])


def test_llama2c_tokenizer_matches_run_c_rules(stories):
    tok = stories.tokenizer
    ids = tok.encode("Once upon a time")
    assert ids[0] == 1  # BOS
    assert tok.decode(ids) == "Once upon a time"  # the dummy-prefix space is dropped after BOS
    text = "Lily saw a dog. It was 3 big dogs!\nThe end."
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("héllo ✓")) == "héllo ✓"  # byte fallback round-trips


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2):
    llm = make_llm(smollm2, exact=True)  # the defaults part at a near-tie of its first token (docs/defaults.md)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy(20))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> is an EOS token


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(smollm2, smollm2_path):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    texts = ["Hello, world!", "The year 2024 had 366 days.", "  spaces\tand\nnewlines  ",
             "<|im_start|>user\nhi<|im_end|>", "naïve café – 東京", "def f(x):\n    return x**2"]
    for t in texts:
        assert smollm2.tokenizer.encode(t) == ref.encode(t, add_special_tokens=False), t
        ids = smollm2.tokenizer.encode(t)
        assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == t
    msgs = [{"role": "user", "content": "Hi"}]
    assert smollm2.tokenizer.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_gguf_config_without_loading_weights(smollm2_path):
    cfg = read_model_config(smollm2_path)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0


def test_interleaved_to_half_rope_reorders_pairs():
    # one head of dim 4, rows (0,1) and (2,3) are RoPE pairs -> halves [0, 2 | 1, 3]
    w = torch.arange(4.0).unsqueeze(1)
    assert interleaved_to_half_rope(w, 1).squeeze(1).tolist() == [0.0, 2.0, 1.0, 3.0]


def test_missing_and_malformed_files_raise_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        load_weights(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.bin"
    bad.write_bytes(struct.pack("<7i", 0, 0, 0, 0, 0, 0, 0))
    with pytest.raises(ModelLoadError, match="not a llama2.c checkpoint"):
        load_weights(str(bad))
    short = tmp_path / "short.bin"
    short.write_bytes(struct.pack("<7i", 64, 172, 5, 8, 4, 512, 512) + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="header implies"):
        load_weights(str(short))
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_weights(str(fake))
    d = tmp_path / "hfdir"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_weights(str(d))


def test_hub_id_offline_fails_naming_the_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="some-org/some-model"):
        load_weights("some-org/some-model")


def test_gguf_file_reads_what_the_gguf_package_reads(tmp_path):
    """Every metadata value type and the tensor types we dequantize ourselves (F32, F16, BF16,
    Q8_0, Q4_0, Q4_1) plus one we hand to gguf.quants (Q5_0), against the gguf package's reader."""
    import gguf
    import numpy as np
    from kvserve.models.loaders.gguf_file import GGUFFile
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("k.u8", 7), w.add_int16("k.i16", -3), w.add_uint32("k.u32", 1 << 31)
    w.add_int64("k.i64", -(1 << 40)), w.add_float32("k.f32", 0.25), w.add_float64("k.f64", 1e-300)
    w.add_bool("k.bool", True), w.add_string("k.str", "héllo")
    w.add_array("k.strs", ["a", "", "ünï"]), w.add_array("k.ints", [1, -2, 3]), w.add_array("k.floats", [0.5, 2.0])
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((6, 64)) * 3).astype(np.float32)
    types = [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16,
             gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
             gguf.GGMLQuantizationType.Q5_0]
    for kind in types:
        w.add_tensor(f"t.{kind.name}", gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    for mine, ref in zip(ours.tensors, theirs.tensors):
        expected = torch.from_numpy(gguf.quants.dequantize(ref.data, ref.tensor_type).copy())
        got = ours.dequantize(mine)
        assert mine.name == ref.name and got.shape == (6, 64) and torch.equal(got, expected), mine.name


def test_truncated_gguf_is_refused(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))  # the header and part of the tokenizer only
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_weights(str(cut))
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(40 << 20))  # the header whole, the tensor data cut short
    with pytest.raises(ModelLoadError, match="truncated"):
        load_weights(str(cut))
