"""A `tokenizers.Tokenizer` behind kvserve's interface, built from tokenizer.json or from the
byte-level BPE vocabulary stored in a GGUF file's metadata."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

from kvserve.tokenizer.base import Tokenizer

# Pre-tokenizer regexes of the llama.cpp `tokenizer.ggml.pre` names we know (from llama-vocab).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CONTROL, USER_DEFINED = 3, 4  # GGUF token types that are special tokens


class HFTokenizer(Tokenizer):
    def __init__(self, tok, bos_token_id: Optional[int], eos_token_ids: Sequence[int],
                 add_bos: bool = False, chat_template: Optional[str] = None) -> None:
        self.tok = tok
        self.bos_token_id, self.eos_token_ids = bos_token_id, tuple(eos_token_ids)
        self.add_bos, self.chat_template = add_bos, chat_template
        self.bos_token = tok.id_to_token(bos_token_id) or "" if bos_token_id is not None else ""
        self.eos_token = tok.id_to_token(self.eos_token_ids[0]) or "" if self.eos_token_ids else ""

    @property
    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None \
                and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    def encode_plain(self, text: str) -> list[int]:
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    @functools.cached_property
    def _plain(self) -> Any:
        """A copy of the tokenizer that reads special tokens' text as text (encode_special_tokens
        is a setting of the whole object, and other threads encode with this one meanwhile)."""
        plain = type(self.tok).from_str(self.tok.to_str())
        plain.encode_special_tokens = True
        return plain


def from_tokenizer_json(path: str, bos_token_id: Optional[int], eos_token_ids: Sequence[int],
                        chat_template: Optional[str]) -> HFTokenizer:
    from tokenizers import Tokenizer as RawTokenizer
    return HFTokenizer(RawTokenizer.from_file(path), bos_token_id, eos_token_ids, False, chat_template)


def from_gguf_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                  pre: str, bos_token_id: Optional[int], eos_token_ids: Sequence[int],
                  add_bos: bool, chat_template: Optional[str]) -> HFTokenizer:
    """Byte-level BPE ('gpt2' in GGUF terms) from the vocabulary, merges and token types."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre, pre_tokenizers, Regex)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False)
                for t, kind in zip(tokens, token_types) if kind in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens(specials)
    return HFTokenizer(tok, bos_token_id, eos_token_ids, add_bos, chat_template)


def _pre_tokenizer(pre: str, pre_tokenizers, Regex):  # type: ignore[no-untyped-def]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    steps = [pre_tokenizers.Split(Regex(_GPT2_REGEX), behavior="isolated"), byte_level]
    if pre in ("smollm", "starcoder", "refact", "codeshell"):  # digits one by one first
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence(steps)
