"""Perplexity of a text through the engine's real cache, and, against a reference cache format,
the mean KL divergence and top-1 agreement on the same tokens (llama.cpp's
`llama-perplexity --kl-divergence`).

The text is cut into windows of `context` tokens starting every `stride` tokens; each window is
one request, prefilled in chunks of `chunk` tokens, so later tokens attend to earlier ones
through the cache in its chosen format (quantized K/V included). A token is scored once, in the
first window that holds it with at least one token before it:

    window i = tokens [i * stride, i * stride + context)
    scored   = its tokens after the previous window's end (after its own first token)

`llama_cpp_perplexity` reproduces llama.cpp's `llama-perplexity` instead: the tokens are cut into
consecutive chunks of `context` tokens (no overlap, a tail shorter than a chunk unscored), each
chunk's first token is replaced by BOS where the tokenizer adds one, and each chunk scores only
its second half, from everything before it in the chunk:

    chunk i = tokens [i * context, (i + 1) * context), BOS in place 0
    scored  = its tokens context / 2 + 1 .. context - 1 (rows context / 2 .. context - 2)

With a reference format a second engine over the same weights runs the same windows in the same
steps; each scored row compares the two distributions: KL(reference || test) and whether their
most likely tokens agree.

`stream` scores a text as one sequence instead (StreamingLLM's evaluation): every token after
the first, each from everything the cache still holds of the text before it, in segments of a
fixed number of tokens, with the blocks the sequence holds as it grows. A dense cache must hold
the whole text (past the model's context it runs positions it never saw); a sliding window, with
or without attention sinks, holds a constant number of blocks whatever the length.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from kvserve.config import OptionError, check_at_least
from kvserve.core.sampling_params import SamplingParams
from kvserve.eval import LLAMA_CPP, STRIDED


@dataclass
class Windows:
    starts: list[int]  # first token of each window
    scored: list[tuple[int, int]]  # per window: [first, end) tokens it scores
    context: int  # tokens per window (the last may be shorter)
    stride: int  # tokens between window starts
    windowing: str = STRIDED  # one of kvserve.eval.WINDOWINGS
    first_token: Optional[int] = None  # put in each window's first place (llama.cpp's BOS)

    @classmethod
    def cut(cls, num_tokens: int, context: int, stride: int) -> "Windows":
        """Windows.cut(10, 4, 4).scored == [(1, 4), (5, 8), (9, 10)]"""
        if context < 2 or not 1 <= stride <= context:
            raise ValueError(f"need context >= 2 and 1 <= stride <= context, got context {context}, stride {stride}")
        starts, scored, prev_end = [], [], 0
        for start in range(0, max(num_tokens - 1, 1), stride):
            end = min(start + context, num_tokens)
            first = max(start + 1, prev_end)
            if first < end:
                starts.append(start)
                scored.append((first, end))
            prev_end = end
            if end == num_tokens:
                break
        return cls(starts, scored, context, stride)

    @classmethod
    def chunks(cls, num_tokens: int, context: int, num_chunks: Optional[int] = None,
               bos_token_id: Optional[int] = None) -> "Windows":
        """llama-perplexity's windows: the first `num_chunks` (default: all) whole chunks of
        `context` tokens, each scoring its tokens after its middle one.

            Windows.chunks(10, 4).scored == [(3, 4), (7, 8)]   # tokens 8, 9: no whole chunk
        """
        check_llama_cpp_options(context, num_chunks)
        num_whole = num_tokens // context
        if num_whole == 0:
            raise OptionError("context", f"{context} is longer than the text ({num_tokens} tokens): "
                                         "llama.cpp windows score whole chunks of --context tokens")
        if num_chunks is not None and num_chunks > num_whole:
            raise OptionError("chunks", f"{num_chunks} is more than the text holds: {num_tokens} tokens "
                                        f"make {num_whole} chunk(s) of {context}")
        starts = [i * context for i in range(num_chunks or num_whole)]
        scored = [(start + context // 2 + 1, start + context) for start in starts]
        return cls(starts, scored, context, context, LLAMA_CPP, bos_token_id)

    def window(self, tokens: list[int], i: int) -> list[int]:
        """The tokens window i runs."""
        window = tokens[self.starts[i]:self.starts[i] + self.context]
        return window if self.first_token is None else [self.first_token] + window[1:]


def check_llama_cpp_options(context: int, num_chunks: Optional[int]) -> None:
    """OptionError unless `context` splits into a context half and a scored half of at least
    one token (even, >= 4) and `num_chunks` is None or >= 1: what needs no text to check."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 4 or context % 2:
        raise OptionError("context", "must be an even number >= 4 with llama.cpp windows (each chunk's first "
                                     f"half is context, its second half scored), got {context!r}")
    if num_chunks is not None:
        check_at_least("chunks", num_chunks, 1)


@dataclass
class PerplexityResult:
    num_tokens: int
    perplexity: float
    mean_nll: float
    kv_cache_dtype: str
    context: int
    stride: int
    windowing: str  # one of kvserve.eval.WINDOWINGS
    reference_kv_dtype: Optional[str] = None
    reference_perplexity: Optional[float] = None
    mean_kl: Optional[float] = None
    top1_agreement: Optional[float] = None
    windows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def delta_perplexity(self) -> Optional[float]:
        if self.reference_perplexity is None:
            return None
        return self.perplexity / self.reference_perplexity - 1

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "delta_perplexity": self.delta_perplexity}


class _Scorer:
    """Sums over scored rows: NLL of the real next token, and against a reference KL and top-1."""

    def __init__(self) -> None:
        self.n = 0
        self.nll = self.ref_nll = self.kl = 0.0
        self.agree = 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref: Optional[torch.Tensor], first: int = 0) -> None:
        """Rows predicting targets (the first at position `first` of the text)."""
        lp = logits.float().log_softmax(-1)
        self.n += len(targets)
        self.nll -= lp.gather(1, targets.unsqueeze(1)).sum().item()
        if ref is not None:
            ref_lp = ref.float().log_softmax(-1)
            self.ref_nll -= ref_lp.gather(1, targets.unsqueeze(1)).sum().item()
            self.kl += (ref_lp.exp() * (ref_lp - lp)).sum().item()
            self.agree += int((ref_lp.argmax(-1) == lp.argmax(-1)).sum().item())


def perplexity(engine: Any, tokens: list[int], context: int, stride: int, reference: Any = None,
               progress: bool = False) -> PerplexityResult:
    """Score `tokens` through `engine` (and `reference`, an engine over the same model with
    another cache format) in windows of `context` tokens every `stride`, each token once. Both
    engines must schedule the same way (the same token budget and chunk)."""
    _check_fits(engine, context)
    return _score_windows(engine, tokens, Windows.cut(len(tokens), context, stride), reference, progress)


def llama_cpp_perplexity(engine: Any, tokens: list[int], context: int, num_chunks: Optional[int] = None,
                         reference: Any = None, progress: bool = False) -> PerplexityResult:
    """llama-perplexity's figure on `tokens` (its `-c context --chunks num_chunks`): whole chunks
    of `context` tokens, BOS first where the engine's tokenizer adds one, each scoring its second
    half. OptionError (naming context or chunks) for a context that is odd or under 4 tokens, or
    more chunks than the tokens hold."""
    _check_fits(engine, context)
    tokenizer = engine.tokenizer
    bos = tokenizer.bos_token_id if tokenizer is not None and tokenizer.add_bos else None
    windows = Windows.chunks(len(tokens), context, num_chunks, bos)
    return _score_windows(engine, tokens, windows, reference, progress)


def _score_windows(engine: Any, tokens: list[int], windows: Windows, reference: Any = None,
                   progress: bool = False) -> PerplexityResult:
    """Run each of `windows` over `tokens` as one request; exp of the mean NLL over every scored token."""
    total, per_window = _Scorer(), []
    bar = _bar(len(windows.starts)) if progress else None
    for i, (start, (first, end)) in enumerate(zip(windows.starts, windows.scored)):
        w = _Scorer()
        _score_window(engine, reference, windows.window(tokens, i), first - start, end - start, w)
        for key in ("n", "nll", "ref_nll", "kl", "agree"):
            setattr(total, key, getattr(total, key) + getattr(w, key))
        per_window.append({"start": start, "tokens": w.n, "perplexity": math.exp(w.nll / w.n)})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    result = PerplexityResult(total.n, math.exp(total.nll / total.n), total.nll / total.n, engine.plan.kv_format.name,
                              windows.context, windows.stride, windows.windowing, windows=per_window)
    if reference is not None:
        result.reference_kv_dtype = reference.plan.kv_format.name
        result.reference_perplexity = math.exp(total.ref_nll / total.n)
        result.mean_kl = total.kl / total.n
        result.top1_agreement = total.agree / total.n
    return result


def _check_fits(engine: Any, context: int) -> None:
    if context > engine.max_model_len:
        raise ValueError(f"--context {context} is longer than the model's context ({engine.max_model_len})")


@dataclass
class StreamResult:
    num_tokens: int
    perplexity: float
    kv_cache_dtype: str
    segment: int
    segments: list[dict[str, Any]]  # per segment: first token, tokens, perplexity, blocks held at its end
    max_blocks_held: int
    max_bytes_held: int
    sliding_window: Optional[int] = None
    attention_sinks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _SegmentScorer(_Scorer):
    """Sums per segment of `size` target positions (positions 1..size are segment 0)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.segments: dict[int, _Scorer] = {}

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref: Optional[torch.Tensor], first: int = 0) -> None:
        super().add(logits, targets, ref, first)
        i = 0
        while i < len(targets):
            seg = (first + i - 1) // self.size
            end = min(len(targets), (seg + 1) * self.size + 1 - first)
            self.segments.setdefault(seg, _Scorer()).add(logits[i:end], targets[i:end], None)
            i = end


def stream(engine: Any, tokens: list[int], segment: int = 2000, progress: bool = False) -> StreamResult:
    """Score every token of `tokens` after the first as one sequence through `engine`'s cache;
    perplexity per `segment` tokens, and the most blocks the sequence held."""
    if segment < 1:
        raise ValueError(f"segment must be >= 1 token, got {segment}")
    if len(tokens) < 2:
        raise ValueError(f"a stream needs at least 2 tokens, got {len(tokens)}")
    scorer = _SegmentScorer(segment)
    held: list[tuple[int, int]] = []  # per step: the rows scored up to, the blocks the sequence held
    bar = _bar(len(tokens) - 1, "token") if progress else None

    def on_step(scored_to: int) -> None:
        held.append((scored_to, engine.kv.num_held_blocks("ppl")))
        if bar is not None:
            bar.n = scored_to
            bar.refresh()

    _score_window(engine, None, tokens, 1, len(tokens), scorer, on_step)
    if bar is not None:
        bar.close()
    segments = []
    for i in sorted(scorer.segments):
        s = scorer.segments[i]
        during = [b for to, b in held if i * segment < to <= (i + 1) * segment] or [0]
        segments.append({"first": 1 + i * segment, "tokens": s.n, "perplexity": math.exp(s.nll / s.n),
                         "max_blocks_held": max(during)})
    cache = engine.config.cache
    most = max((b for _, b in held), default=0)
    return StreamResult(scorer.n, math.exp(scorer.nll / scorer.n), engine.plan.kv_format.name, segment, segments,
                        most, most * engine.plan.block_bytes, cache.sliding_window, cache.attention_sinks)


def _score_window(engine: Any, reference: Any, window: list[int], first: int, end: int, scorer: _Scorer,
                  on_step: Optional[Any] = None) -> None:
    """Rows at positions first - 1 .. end - 2 predict tokens first .. end - 1."""
    engines = [engine] if reference is None else [engine, reference]
    rows: list[list[tuple[int, torch.Tensor]]] = [[] for _ in engines]
    stops = []
    for i, e in enumerate(engines):
        stops.append(e.on_prompt_logits.add(lambda rid, start, logits, i=i: rows[i].append((start, logits))))
        e.add_request("ppl", window, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0))
    targets = torch.tensor(window)
    try:
        while engine.has_unfinished():
            for e in engines:
                for out in e.step():
                    if out.error:  # a text scored in part is no score
                        raise ValueError(f"scoring stopped at a failed request: {out.error}")
            for chunks in zip(*rows):  # the same step in each engine: the same positions
                start, logits = chunks[0]
                assert all(c[0] == start for c in chunks), "the engines scheduled the window differently"
                lo, hi = max(start, first - 1), min(start + len(logits), end - 1)
                if lo < hi:
                    pick = [c[1][lo - start:hi - start] for c in chunks]
                    scorer.add(pick[0], targets[lo + 1:hi + 1], pick[1] if reference is not None else None, lo + 1)
                if on_step is not None:
                    on_step(start + len(chunks[0][1]))
            for r in rows:
                r.clear()
    finally:
        for stop in stops:
            stop()
        for e in engines:
            e.abort("ppl")


def _bar(total: int, unit: str = "window"):  # type: ignore[no-untyped-def]
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc="perplexity", unit=unit, file=sys.stderr)
    except ImportError:
        return None
