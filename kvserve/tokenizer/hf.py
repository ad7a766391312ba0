"""A `tokenizers.Tokenizer` behind kvserve's interface, built from tokenizer.json or from the
byte-level BPE vocabulary stored in a GGUF file's metadata."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from kvserve.tokenizer.base import Tokenizer
from kvserve.tokenizer.merges import scored_merges, vocabulary_merges

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
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # GGUF token types that are special tokens


class HFTokenizer(Tokenizer):
    """`tok`: a tokenizers.Tokenizer."""

    def __init__(self, tok: Any, bos_token_id: Optional[int], eos_token_ids: Sequence[int],
                 add_bos: bool = False, chat_template: Optional[str] = None) -> None:
        self.tok = tok
        self.bos_token_id, self.eos_token_ids = bos_token_id, tuple(eos_token_ids)
        self.add_bos, self.chat_template = add_bos, chat_template

    @functools.cached_property
    def bos_token(self) -> str:  # type: ignore[override]
        return self.tok.id_to_token(self.bos_token_id) or "" if self.bos_token_id is not None else ""

    @functools.cached_property
    def eos_token(self) -> str:  # type: ignore[override]
        return self.tok.id_to_token(self.eos_token_ids[0]) or "" if self.eos_token_ids else ""

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
END_OF_TURN_TEXTS = ("<end_of_turn>", "<|end|>")  # control tokens llama.cpp ends a generation on by their text


@dataclass(frozen=True)
class SpmStyle:
    """How a sentencepiece-style vocabulary ('llama' in GGUF terms, no merges in the file) becomes
    a BPE, as transformers builds it from the same file (and llama.cpp encodes alike):

        merges_by_score   False: every split of a token into two tokens is a merge, ranked by the
                          token's place in the file (Gemma: its scores do not follow its merge
                          order); True: ranked by the token's score, best first (sentencepiece's
                          BPE: Llama 2, Phi-3)
        add_space_prefix  a space before the text and after each special token (sentencepiece's
                          dummy prefix), dropped again when decoding
        rstrip_specials   control tokens swallow the whitespace after them, but for those named in
                          keep_whitespace_after (llama.cpp's RSTRIP attribute for Phi-3's tokens)
    """
    merges_by_score: bool = False
    add_space_prefix: bool = False
    rstrip_specials: bool = False
    keep_whitespace_after: tuple[str, ...] = ()

    def check(self, scores: Optional[Sequence[float]], num_tokens: int) -> None:
        if self.merges_by_score and (scores is None or len(scores) < num_tokens):
            raise ValueError("a vocabulary whose merges follow its scores needs tokenizer.ggml.scores for every token")

    def merges(self, vocab: dict[str, int], scores: Optional[Sequence[float]] = None) -> list[tuple[str, str]]:
        if not self.merges_by_score:
            return vocabulary_merges(vocab)
        self.check(scores, len(vocab))
        assert scores is not None
        return scored_merges(vocab, scores)

    def rstrip(self, token: str) -> bool:
        return self.rstrip_specials and token not in self.keep_whitespace_after


GEMMA_STYLE = SpmStyle()
PHI3_STYLE = SpmStyle(merges_by_score=True, add_space_prefix=True, rstrip_specials=True,
                      keep_whitespace_after=("<unk>", "<s>", "<|endoftext|>"))


def from_gguf_spm(tokens: Sequence[str], token_types: Sequence[int], bos_token_id: Optional[int],
                  eos_token_ids: Sequence[int], add_bos: bool, chat_template: Optional[str],
                  style: SpmStyle = GEMMA_STYLE, scores: Optional[Sequence[float]] = None) -> HFTokenizer:
    """A sentencepiece-style vocabulary read as `style` says: BPE over the text with spaces written
    as U+2581, byte fallback to <0xXX> tokens, merges implied by the vocabulary (SpmStyle). This
    is the tokenizer transformers builds from the same file, so both encode alike; control tokens
    and the unknown token are special, user-defined ones (Gemma's newline runs) matched whole."""
    style.check(scores, len(tokens))  # refused now, not at the first encode
    last = {t: i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS}
    eos = list(eos_token_ids) + [i for i in last.values() if i < len(token_types) and token_types[i] == CONTROL
                                 and i not in eos_token_ids]
    merges = functools.partial(style.merges, scores=scores)
    return HFTokenizer(_build_spm(list(tokens), list(token_types), style, merges), bos_token_id, eos, add_bos,
                       chat_template)


def _build_spm(tokens: list[str], token_types: list[int], style: SpmStyle, merges: Any) -> Any:
    from tokenizers import AddedToken, Tokenizer as RawTokenizer, models
    spelled = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]  # "  " stored as spaces
    vocab = {t: i for i, t in enumerate(spelled)}
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=merges(vocab), unk_token=_unk(spelled),
                                  fuse_unk=True, byte_fallback=True))
    _spm_pipeline(tok, style)
    kinds = list(zip(tokens, token_types))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=style.rstrip(t))
                            for t, k in kinds if k in (CONTROL, UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)  # the respelled space runs are plain vocabulary
                    for t, k in kinds if k == USER_DEFINED and t in vocab])
    return tok


def _spm_pipeline(tok: Any, style: SpmStyle) -> None:
    """Normalizer, pre-tokenizer and decoder: spaces as U+2581 (and a leading one where the style
    adds a prefix space; decoding drops it)."""
    from tokenizers import decoders, normalizers, pre_tokenizers
    if style.add_space_prefix:  # the whole text is one word, as sentencepiece reads it
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if style.add_space_prefix else steps)


def _unk(tokens: Sequence[str]) -> Optional[str]:
    return "<unk>" if "<unk>" in tokens else None
