"""A `tokenizers.Tokenizer` behind kvserve's interface, built from tokenizer.json or from the
byte-level BPE vocabulary stored in a GGUF file's metadata."""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Sequence

from kvserve.tokenizer.base import Tokenizer

log = logging.getLogger(__name__)

# Pre-tokenizer regexes of llama.cpp's `tokenizer.ggml.pre` names (llama-vocab.cpp's pre types),
# as the models' own tokenizer.json files write them.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
                r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
                r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = "digits"  # each digit its own piece, then the GPT-2 regex (llama.cpp's "\p{N}" first)
PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> how its text is split before BPE
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), _LLAMA3_REGEX),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"), _QWEN2_REGEX),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_REGEX),
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
                     "mellum", "a.x-4.0", "gigachat", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
                     "jina-v1-en", "jina-v2-code", "roberta-bpe"), _GPT2_REGEX),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _DIGITS),
}
# names llama.cpp splits by patterns kvserve does not reproduce: encoding with another would be wrong
UNSERVED_PRE_TOKENIZERS = ("default", "deepseek-llm", "deepseek-coder", "deepseek-v3", "hunyuan-dense", "falcon",
                           "poro-chat", "bloom", "gpt3-finnish", "viking", "tekken", "chameleon", "superbpe",
                           "bailingmoe", "bailingmoe2", "llada-moe", "seed-coder", "kimi-k2", "afmoe")
_warned_pre: set[str] = set()
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
        is a setting of the whole object, and other threads encode with this one meanwhile). It
        shares the (read-only) model, so a vocabulary of 262k tokens and 500k merges is not
        serialized and parsed again; if the added tokens do not get their ids back, a full copy."""
        plain = type(self.tok)(self.tok.model)
        for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
            if getattr(self.tok, part) is not None:
                setattr(plain, part, getattr(self.tok, part))
        added = sorted(self.tok.get_added_tokens_decoder().items())
        plain.add_special_tokens([t for _, t in added if t.special])
        plain.add_tokens([t for _, t in added if not t.special])
        if any(plain.token_to_id(t.content) != i for i, t in added):
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
    split = pre_tokenizer_regex(pre)
    steps = [pre_tokenizers.Split(Regex(_GPT2_REGEX if split == _DIGITS else split), behavior="isolated"), byte_level]
    if split == _DIGITS:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence(steps)


def pre_tokenizer_regex(pre: str) -> str:
    """The split regex of a GGUF's pre-tokenizer name (or _DIGITS). A name llama.cpp splits by a
    pattern kvserve lacks is refused; a name unknown to both is split as GPT-2 does, with a
    warning naming it (once per name), as llama.cpp warns and falls back."""
    if pre in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[pre]
    if pre in UNSERVED_PRE_TOKENIZERS:
        raise ValueError(f"the GGUF's BPE pre-tokenizer {pre!r} is not supported (its text would be split "
                         f"differently from its model's tokenizer); supported: {sorted(PRE_TOKENIZERS)}; "
                         "pass --tokenizer with a tokenizer.json")
    if pre not in _warned_pre:
        _warned_pre.add(pre)
        log.warning("unknown BPE pre-tokenizer %r in the GGUF: splitting its text as GPT-2 does; tokens may "
                    "differ from its model's tokenizer (pass --tokenizer with a tokenizer.json to be sure)", pre)
    return _GPT2_REGEX


SPACE = "\u2581"  # sentencepiece's visible space
END_OF_TURN_TEXTS = ("<end_of_turn>",)  # control tokens llama.cpp ends a generation on by their text


def from_gguf_spm(tokens: Sequence[str], token_types: Sequence[int], bos_token_id: Optional[int],
                  eos_token_ids: Sequence[int], add_bos: bool, chat_template: Optional[str]) -> HFTokenizer:
    """A sentencepiece-style vocabulary ('llama' in GGUF terms) without a prefix space, as Gemma
    stores it: BPE over the text with spaces written as U+2581, byte fallback to <0xXX> tokens,
    and no merges in the file. They are the vocabulary's own: every token that splits into two
    tokens is a merge, ranked by the token's place in the file (Gemma's scores do not follow its
    merge order). This is the tokenizer transformers builds from the same file, so both encode
    alike; control tokens are special, user-defined ones (Gemma's newline runs) matched whole."""
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    spelled = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]  # "  " stored as spaces
    vocab = {t: i for i, t in enumerate(spelled)}
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=vocabulary_merges(vocab), unk_token=_unk(spelled),
                                  fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    kinds = list(zip(tokens, token_types))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)  # the respelled space runs are plain vocabulary
                    for t, k in kinds if k == USER_DEFINED and t in vocab])
    eos = list(eos_token_ids) + [vocab[t] for t in END_OF_TURN_TEXTS
                                 if t in vocab and token_types[vocab[t]] == CONTROL and vocab[t] not in eos_token_ids]
    return HFTokenizer(tok, bos_token_id, eos, add_bos, chat_template)


def vocabulary_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens whose concatenation is a token, best first: the earlier
    the concatenation in the vocabulary, the better; for one token, the longer left part first.

        vocab  a:0 b:1 ab:2 c:3 abc:4 bc:5   ->   (a, b) (ab, c) (a, bc) (b, c)
    """
    merges = []
    for token, rank in vocab.items():
        for cut in range(len(token) - 1, 0, -1):  # longer left part first
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((rank, left, right))
    merges.sort(key=lambda m: m[0])  # stable: within a token the order above stays
    return [(left, right) for _, left, right in merges]


def _unk(tokens: Sequence[str]) -> Optional[str]:
    return "<unk>" if "<unk>" in tokens else None
