"""GGUF vocabularies as tokenizers: each `tokenizer.ggml.pre` name llama.cpp knows splits text as
llama.cpp's llama-vocab.cpp maps it (Llama 3's digit triples, Qwen2's single digits, SmolLM's
digits first, GPT-4o's contractions kept on their words, GPT-2's runs); names llama.cpp splits
by a pattern kvserve lacks are refused, unknown names warned about once; the plain-text copy of
a tokenizer encodes as a full copy does; merges implied by a vocabulary come best first."""

import logging

import pytest

from kvserve.tokenizer import hf

pytest.importorskip("tokenizers")

TEXT = "I'M 12345 caf\u00e9s\n\nDon't"
# byte-level pieces (space: \u0120, newline: \u010a, "\u00e9" as its two bytes \u00c3\u00a9)
SPLITS = {
    "llama-bpe": ["I", "'M", "\u0120", "123", "45", "\u0120caf\u00c3\u00a9s", "\u010a\u010a", "Don", "'t"],
    "dbrx": ["I", "'M", "\u0120", "123", "45", "\u0120caf\u00c3\u00a9s", "\u010a\u010a", "Don", "'t"],
    "qwen2": ["I", "'M", "\u0120", "1", "2", "3", "4", "5", "\u0120caf\u00c3\u00a9s", "\u010a\u010a", "Don", "'t"],
    "gpt-4o": ["I'M", "\u0120", "123", "45", "\u0120caf\u00c3\u00a9s", "\u010a\u010a", "Don't"],
    "smollm": ["I", "'", "M", "\u0120", "1", "2", "3", "4", "5", "\u0120caf\u00c3\u00a9s", "\u010a", "\u010a", "Don",
               "'t"],
    "olmo": ["I", "'", "M", "\u012012345", "\u0120caf\u00c3\u00a9s", "\u010a", "\u010a", "Don", "'t"],
}


def split(pre):
    from tokenizers import Regex, pre_tokenizers
    return [piece for piece, _ in hf._pre_tokenizer(pre, pre_tokenizers, Regex).pre_tokenize_str(TEXT)]


@pytest.mark.parametrize("pre", list(SPLITS))
def test_known_names_split_as_llama_cpp_maps_them(pre):
    assert split(pre) == SPLITS[pre]


def test_every_known_name_builds_and_shares_its_family_split():
    families = {hf._LLAMA3_REGEX: "llama-bpe", hf._QWEN2_REGEX: "qwen2", hf._GPT4O_REGEX: "gpt-4o",
                hf._GPT2_REGEX: "olmo", hf._DIGITS: "smollm"}
    for pre, regex in hf.PRE_TOKENIZERS.items():
        assert split(pre) == SPLITS[families[regex]], pre
    assert not set(hf.PRE_TOKENIZERS) & set(hf.UNSERVED_PRE_TOKENIZERS)


def bpe(pre, tokens=("a", "b", "ab", "<|im_start|>")):
    return hf.from_gguf_bpe(list(tokens), ["a b"], [1, 1, 1, hf.CONTROL], pre, None, [], False, None)


def test_names_split_by_patterns_kvserve_lacks_are_refused():
    with pytest.raises(ValueError, match=r"pre-tokenizer 'deepseek-llm' is not supported.*supported: \[.*'llama-bpe'"):
        bpe("deepseek-llm")


def test_an_unknown_name_is_split_as_gpt2_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.tokenizer.hf"):
        first, second = bpe("brand-new-pre"), bpe("brand-new-pre")
    warnings = [r.getMessage() for r in caplog.records if "brand-new-pre" in r.getMessage()]
    assert len(warnings) == 1 and "GPT-2" in warnings[0]
    assert first.encode("ab ab") == second.encode("ab ab") == bpe("gpt2").encode("ab ab")


def test_plain_copy_reads_special_text_as_text_as_a_full_copy_does():
    tok = bpe("qwen2")
    text = "<|im_start|>ab"
    assert tok.encode(text, add_special_tokens=False) == [3, 2]
    full = type(tok.tok).from_str(tok.tok.to_str())
    full.encode_special_tokens = True
    assert tok.encode_plain(text) == list(full.encode(text, add_special_tokens=False).ids) != [3, 2]
    assert tok.encode(text, add_special_tokens=False) == [3, 2]  # the original still reads it as special


def test_plain_copy_of_a_sentencepiece_vocabulary():
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "a", "b", "ab", "\u2581", "\u2581ab"]
    types = [hf.CONTROL] * 5 + [1] * 5
    tok = hf.from_gguf_spm(tokens, types, 2, [1], True, None)
    assert tok.encode("<start_of_turn>ab ab") == [2, 4, 7, 9]
    assert 4 not in tok.encode_plain("<start_of_turn>ab ab")
    full = type(tok.tok).from_str(tok.tok.to_str())
    full.encode_special_tokens = True
    assert tok.encode_plain("<start_of_turn>ab") == list(full.encode("<start_of_turn>ab", add_special_tokens=False).ids)


def test_vocabulary_merges_best_first():
    vocab = {"a": 0, "b": 1, "ab": 2, "c": 3, "abc": 4, "bc": 5}
    assert hf.vocabulary_merges(vocab) == [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]


def test_scored_merges_best_score_first():
    vocab = {"a": 0, "b": 1, "ab": 2, "c": 3, "abc": 4, "bc": 5}
    scores = [-1.0, -2.0, -3.0, -4.0, -0.5, -5.0]
    assert hf.scored_merges(vocab, scores) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]


def test_a_prefix_space_vocabulary_ranks_merges_by_score():
    """Phi-3's style: a space before the text (dropped again by decoding); with "a b" scored
    above "▁a" the text "ab" is "▁" + "ab", where place order would give "▁a" + "b"."""
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "<|end|>"]
    types = [2, hf.CONTROL, hf.CONTROL, 1, 1, 1, 1, 1, hf.CONTROL]
    scores = [0.0, 0.0, 0.0, -10.0, -11.0, -12.0, -2.0, -1.0, 0.0]
    tok = hf.from_gguf_spm(tokens, types, 1, [2], True, None, hf.PHI3_STYLE, scores)
    assert tok.encode("ab") == [1, 3, 7] and tok.decode([1, 3, 7]) == "ab"
    place = hf.from_gguf_spm(tokens, types, 1, [2], True, None, hf.SpmStyle(add_space_prefix=True), scores)
    assert place.encode("ab") == [1, 6, 5]
    assert tok.encode("<|end|>\n b", add_special_tokens=False) == [8, 3, 5]  # the newline and space swallowed
    assert set(tok.eos_token_ids) == {2, 8}
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        hf.from_gguf_spm(tokens, types, 1, [2], True, None, hf.PHI3_STYLE, None)
