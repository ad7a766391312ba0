"""A Phi-3 GGUF's sentencepiece-style vocabulary ('llama', a prefix space, merges ranked by the
tokens' scores, byte fallback, Phi-3's special tokens) on a tiny random Phi-3 written as llama.cpp's
converter writes one: its tokens equal transformers' reading of the same file (`gguf_file=`), byte
fallback spells what the vocabulary lacks, and greedy generation through kvserve's cache equals
transformers' generate on the same weights, prompt encoded and output decoded alike. F16 and BF16
matrices load as torch float16 / bfloat16 tensors holding the file's values, and an fp32 model
built from them computes what transformers computes with its weights rounded the same way."""

import copy

import numpy as np
import pytest
import torch

from tests.conftest import greedy, make_engine, run_collecting_logits
from tests.models.test_dense_families import COMMON, GGUF_NAMES

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SPACE = "\u2581"
TEXTS = [
    "the cat sat on the mat",
    "  two spaces, then the hat; then a dot.",
    "tea at three: the cat that ate the hat",
    "<|user|>hi the cat<|end|><|assistant|>",  # (whitespace after a special token: its own test below)
    "<|system|>sit<|end|><|user|>the  mat <|end|>",
    "",
]
SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]
UNKNOWN, CONTROL, NORMAL, BYTE = 2, 3, 1, 6  # GGUF token types


def phi3_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """<unk> <s> </s>, the 256 byte tokens, the texts' characters, their pairs and half their longer pieces
    with seeded random scores (so the order by score is not the order in the file), Phi-3's specials."""
    words = {w for t in TEXTS for w in t.replace("<|", " ").replace("|>", " ").split()}
    chars = sorted({c for w in words for c in w} | {SPACE})
    pieces: set[str] = set()
    for w in sorted(words):
        spelled = SPACE + w
        for n in range(2, len(spelled) + 1):
            pieces.update(spelled[i:i + n] for i in range(len(spelled) - n + 1))
    rng = np.random.default_rng(0)
    ordered = [p for p in sorted(pieces - set(chars)) if len(p) == 2 or rng.random() < 0.5]  # some words: several tokens
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + ordered + SPECIALS
    scores = [0.0] * 259 + [-1000.0 - i for i in range(len(chars))] + \
        rng.uniform(-900, -1, len(ordered)).round(2).tolist() + [0.0] * len(SPECIALS)
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(chars) + len(ordered)) + \
        [CONTROL] * len(SPECIALS)
    return tokens, scores, types


def write_phi3_gguf(path, hf, tokens, scores, types, matrices="F32"):
    """The tensors and metadata llama.cpp's converter writes; the matrices in `matrices` (F32,
    F16 or BF16), the norms in F32."""
    cfg, sd = hf.config, {k: v.numpy() for k, v in hf.state_dict().items()}
    kind = gguf.GGMLQuantizationType[matrices]
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_name("Phi3 tiny")
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size), w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads), w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps), w.add_rope_dimension_count(16)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_tokenizer_model("llama"), w.add_token_list(tokens), w.add_token_scores(scores), w.add_token_types(types)
    w.add_bos_token_id(1), w.add_eos_token_id(tokens.index("<|endoftext|>")), w.add_unk_token_id(0)
    w.add_add_bos_token(True), w.add_add_eos_token(False), w.add_add_space_prefix(True)

    def add(name, a):
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)

    add("token_embd.weight", sd["model.embed_tokens.weight"]), add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    for key, a in sd.items():
        if key.startswith("model.layers."):
            i, inner = key.split(".")[2], ".".join(key.split(".")[3:-1])
            add(f"blk.{i}.{GGUF_NAMES[inner]}.weight", a)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(kvserve's load of the file, transformers' tokenizer from the file, the transformers model)."""
    from kvserve.models.registry import load_weights
    tokens, scores, types = phi3_vocabulary()
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**COMMON, "vocab_size": len(tokens)})).eval()
    with torch.no_grad():  # norms and embeddings away from their initial values: make them count
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    directory = tmp_path_factory.mktemp("phi3")
    write_phi3_gguf(directory / "phi3.gguf", hf, tokens, scores, types)
    ref = transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file="phi3.gguf")
    return load_weights(str(directory / "phi3.gguf")), ref, hf


def test_tokens_equal_transformers_reading_of_the_file(phi3):
    loaded, ref, _ = phi3
    tok = loaded.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    assert tok.encode("x")[0] == tok.bos_token_id == 1


def test_merges_follow_the_scores_not_the_place_in_the_file(phi3):
    """The same vocabulary with merges in file order (Gemma's rule) encodes some text otherwise:
    the score order is what decides, and it is the one transformers reads."""
    from kvserve.tokenizer import hf
    loaded, ref, _ = phi3
    tokens, _, types = phi3_vocabulary()
    by_place = hf.from_gguf_spm(tokens, types, 1, [], True, None, hf.SpmStyle(
        merges_by_score=False, add_space_prefix=True))
    differ = [t for t in TEXTS if by_place.encode(t) != loaded.tokenizer.encode(t)]
    assert differ and all(loaded.tokenizer.encode(t) == ref(t).input_ids for t in differ)


def test_special_tokens_swallow_the_whitespace_after_them_as_llama_cpp_reads_phi3(phi3):
    loaded, _, _ = phi3
    tok = loaded.tokenizer
    user, end = tok.special_tokens["<|user|>"], tok.special_tokens["<|end|>"]
    assert tok.encode("<|user|>\n hi", add_special_tokens=False) == [user] + tok.encode("hi", add_special_tokens=False)
    assert tok.encode("<|end|>", add_special_tokens=False) == [end] and end in tok.eos_token_ids
    assert "<|endoftext|>" in {tok.tok.id_to_token(i) for i in tok.eos_token_ids}
    eot = tok.special_tokens["<|endoftext|>"]  # one of the tokens llama.cpp lets keep the whitespace
    assert tok.encode("<|endoftext|> hi", add_special_tokens=False)[:2] == [eot, tok.tok.token_to_id(SPACE)]


def test_what_the_vocabulary_lacks_falls_back_to_bytes(phi3):
    loaded, _, _ = phi3
    tok = loaded.tokenizer
    ids = tok.encode("the \u00e9\U0001f916", add_special_tokens=False)
    byte_ids = [3 + b for b in "\u00e9\U0001f916".encode("utf-8")]  # <0xXX> is token 3 + XX
    assert ids[-len(byte_ids):] == byte_ids and tok.decode(ids) == "the \u00e9\U0001f916"


def test_greedy_generation_equals_transformers(phi3):
    """Prompts encoded by kvserve (equal to transformers' encoding above), 16 greedy tokens through
    kvserve's cache in small blocks: transformers' generate on the same weights gives the same
    tokens, and both decode them to the same text."""
    loaded, ref, hf = phi3
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS[:4]]
    engine = make_engine(loaded, block_size=4, num_blocks=64, attention_backend="torch")
    outs, _ = run_collecting_logits(engine, prompts, greedy(16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected
        assert loaded.tokenizer.decode(expected) == ref.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("matrices", ["F16", "BF16"])
def test_sixteen_bit_matrices_load_as_sixteen_bit_tensors(phi3, tmp_path, matrices):
    from kvserve.models.loaders.gguf_file import GGUFFile
    from kvserve.models.registry import build_model, checkpoint_dtype, load_weights
    from tests.models.test_hf_parity import full_logits
    _, _, hf = phi3
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}[matrices]
    path = tmp_path / f"phi3-{matrices}.gguf"
    write_phi3_gguf(path, hf, *phi3_vocabulary(), matrices=matrices)
    loaded = load_weights(str(path))
    sd = loaded.state_dict
    assert {v.dtype for v in sd.values() if v.dim() == 2} == {dtype}
    assert {v.dtype for v in sd.values() if v.dim() == 1} == {torch.float32}
    assert checkpoint_dtype(loaded) == {"F16": "float16", "BF16": "bfloat16"}[matrices]
    stored = {t.name: t for t in GGUFFile(str(path)).tensors}
    expected = GGUFFile(str(path)).dequantize(stored["token_embd.weight"])  # gguf's float32 of the stored bits
    assert torch.equal(sd["model.embed_tokens.weight"].float(), expected)
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                p.copy_(p.to(dtype).float())
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = rounded(torch.tensor([ids])).logits[0]
    ours = full_logits(build_model(loaded, torch.float32, "cpu", 512), ids)
    assert (ours - ref).abs().max().item() < 1e-4


def test_other_families_sentencepiece_vocabularies_are_refused_by_name(tmp_path):
    """A Llama 2 style file ('llama' vocabulary in a 'llama' model): not checked against its
    model's tokenizer here, so refused, naming the families that are read."""
    from kvserve.models.loaders.base import ModelLoadError
    from kvserve.models.registry import load_weights
    tokens, scores, types = phi3_vocabulary()
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_block_count(1), w.add_embedding_length(64), w.add_feed_forward_length(96), w.add_head_count(4)
    w.add_tokenizer_model("llama"), w.add_token_list(tokens), w.add_token_scores(scores), w.add_token_types(types)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"vocabulary of a 'llama' file is not supported \(\['gemma2', "
                                             r"'gemma3', 'phi3'\] are\)"):
        load_weights(str(tmp_path / "llama.gguf"))
