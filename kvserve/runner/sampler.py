"""Sampling: logits [N, vocab] of the rows that sample -> token ids, one request per row.

Each row's logit_bias comes first, then the structured-output mask and penalties; greedy rows
take the argmax; the others go through temperature, top-k, top-p and min-p (vectorized), then draw with random numbers that depend only on the request's key (its
seed) and the output position of the token being drawn (`draw_seed`). Nothing advances from
one call to the next, so a seed reproduces its tokens whatever else is in the batch, however
many guesses were checked and rejected, and however often the request was preempted and its
step drawn again.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Optional, Sequence

import torch

from kvserve import kernels
from kvserve.core.outputs import ScheduledSequence
from kvserve.core.sampling_params import SamplingParams


class TokenHistory:
    """What penalties read of one request, kept up to date in place: which tokens its prompt and
    output hold (`seen`) and how often each occurs in the output (`counts`). Each step adds only
    its new tokens, so a long output costs nothing per step."""

    def __init__(self, vocab_size: int, prompt_ids: Sequence[int], device: torch.device) -> None:
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab_size, dtype=torch.long, device=device)
        self.num_outputs = 0
        self.seen[_ids(prompt_ids, vocab_size, device)] = True

    def catch_up(self, output_ids: Sequence[int]) -> None:
        new = _ids(output_ids[self.num_outputs:], self.counts.shape[0], self.counts.device)
        self.counts.index_add_(0, new, torch.ones_like(new))
        self.seen[new] = True
        self.num_outputs = len(output_ids)

    def with_tokens(self, token_ids: Sequence[int]) -> "TokenHistory":
        """A copy that has also seen token_ids (the proposals before a row being verified)."""
        other = copy.copy(self)
        new = _ids(token_ids, self.counts.shape[0], self.counts.device)
        other.seen, other.counts = self.seen.clone(), self.counts.clone()
        other.counts.index_add_(0, new, torch.ones_like(new))
        other.seen[new] = True
        return other


def _ids(ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    t = torch.tensor(list(ids), dtype=torch.long, device=device)
    return t[t < vocab_size]


def apply_penalties(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """One row [vocab]: repetition over prompt and output; presence/frequency over output."""
    if params.repetition_penalty != 1.0:
        vals = logits[history.seen]
        logits[history.seen] = torch.where(vals > 0, vals / params.repetition_penalty,
                                           vals * params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        counts = history.counts.to(logits.dtype)
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    logits.copy_(bounded(logits))
    return logits


def with_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Rows [R, vocab] with each row's logit_bias added (a copy; the input itself where no row has
    a bias). It comes first, before penalties, filters and structured-output masks, as OpenAI's
    and vLLM's, so a banned token stays banned and a mask still has the last word."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    biased = logits.clone()
    for i in rows:
        ids, bias = zip(*params[i].logit_bias)
        biased[i, list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    return biased


def bounded(logits: torch.Tensor) -> torch.Tensor:
    """Overflow to +inf (a repetition penalty or temperature near 0 divides by almost nothing)
    becomes the largest finite value, so softmax stays a distribution; NaN becomes excluded."""
    return logits.nan_to_num(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Rows [R, vocab] -> temperature-scaled logits with excluded tokens set to -inf."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    # shifted so the favourite is 0 first: a temperature near 0 then tends to greedy instead of
    # overflowing (softmax, top-p and min-p do not change under the shift)
    logits = bounded(logits)
    logits = bounded((logits - logits.max(-1, keepdim=True).values) / temp)
    top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
    top_p = [p.top_p for p in params]
    if any(k < logits.shape[1] for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, torch.tensor(top_k, device=dev), torch.tensor(top_p, device=dev))
    min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # drop a token when the tokens ranked above it already hold top_p of the mass
    drop |= (probs.cumsum(-1) - probs) >= p.unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: odd, so positions never collide


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers in which every input bit moves
    every output bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def draw_seed(key: int, position: int) -> int:
    """The seed of the random numbers that choose a request's token at an output position: a
    function of (key, position) only, the same on every run, in every batch, before or after a
    preemption; e.g. draw_seed(42, 0) == 10996452266160306281, draw_seed(42, 1) ==
    2958219263312191191. Any int is a key (a negative or huge seed is taken modulo 2**64)."""
    return _mix64((_mix64(key & MASK64) + (position + 1) * GOLDEN_GAMMA) & MASK64)


def draw(probs: torch.Tensor, num: int, seed: int, generator: torch.Generator) -> list[int]:
    """num tokens from probs [vocab] (non-negative, any total) with the random numbers of one
    seed: each is the winner of an exponential race, argmax(p / E) with E ~ Exp(1) drawn per
    token, which picks token i with probability p_i / sum(p) (Gumbel-max written without logs).
    Whoever draws with the same seed over the same vocabulary races the same E, so a draft
    model's guess and the target's token agree as often as their distributions allow."""
    generator.manual_seed(seed)
    noise = torch.empty((num, probs.shape[-1]), device=probs.device).exponential_(generator=generator)
    # an E of exactly 0 (possible in fp32) would make 0 / 0 = NaN, which argmax would pick
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(-1).tolist()


class Sampler:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.keys: dict[str, int] = {}  # request -> the key of its random numbers (`draw_seed`)
        self.histories: dict[str, TokenHistory] = {}
        self._num_unseeded = 0
        self._generators: dict[torch.device, torch.Generator] = {}  # reseeded before every draw
        self.structured: Optional[Any] = None  # StructuredOutputs, where the model's tokenizer can drive one

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.keys.pop(rid, None)
            self.histories.pop(rid, None)
        if self.structured is not None:
            self.structured.forget(request_ids)

    def adopt(self, request_id: str, key: int) -> None:
        """Draw a request's tokens with a key given elsewhere (another engine drew its first
        token; a draft draws its guesses with its target's key)."""
        self.keys[request_id] = key

    def key(self, request_id: str) -> Optional[int]:
        """The key of the request's random numbers (None: it has drawn nothing yet)."""
        return self.keys.get(request_id)

    def save(self, request_ids: Sequence[str]) -> tuple[dict[str, Optional[int]], int, Any]:
        """The keys given (and grammar state) of these requests, to draw their step again
        (`restore`): an unseeded request keeps the key of its arrival, not of a retry."""
        keys = {rid: self.keys.get(rid) for rid in request_ids}
        return keys, self._num_unseeded, self.structured.save(request_ids) if self.structured else None

    def restore(self, saved: tuple[dict[str, Optional[int]], int, Any]) -> None:
        keys, self._num_unseeded, matchers = saved
        if self.structured is not None:
            self.structured.restore(matchers)
        for rid, key in keys.items():
            if key is None:
                self.keys.pop(rid, None)
            else:
                self.keys[rid] = key

    def _key(self, seq: ScheduledSequence) -> int:
        key = self.keys.get(seq.request_id)
        if key is None:
            if seq.seed is not None:
                key = seq.seed
            else:  # reproducible from the engine seed and arrival order
                key = self.seed * 1_000_003 + self._num_unseeded
                self._num_unseeded += 1
            self.keys[seq.request_id] = key
        return key

    def _draw(self, probs: torch.Tensor, seq: ScheduledSequence, position: int, num: int) -> list[int]:
        """num tokens for the request's output position `position` from probs [vocab]."""
        g = self._generators.get(probs.device)
        if g is None:
            g = self._generators[probs.device] = torch.Generator(device=probs.device)
        return draw(probs, num, draw_seed(self._key(seq), position), g)

    def _history(self, seq: ScheduledSequence, logits: torch.Tensor) -> TokenHistory:
        h = self.histories.get(seq.request_id)
        if h is None:
            h = self.histories[seq.request_id] = TokenHistory(logits.shape[-1], seq.prompt_token_ids, logits.device)
        h.catch_up(seq.output_token_ids)
        return h

    def __call__(self, logits: torch.Tensor, seqs: Sequence[ScheduledSequence]
                 ) -> tuple[list[list[int]], list[Optional[list[dict[int, float]]]]]:
        """logits [N, vocab] fp32, one row per sequence -> num_samples ids per sequence, each
        for the sequence's next output position (n > 1: the n samples of the fork point)."""
        if self.structured is None and all(is_plain_greedy(s.sampling_params) for s in seqs):
            return greedy_tokens(logits, seqs), [None] * len(seqs)
        return self.general(logits, seqs)

    def general(self, logits: torch.Tensor, seqs: Sequence[ScheduledSequence]
                ) -> tuple[list[list[int]], list[Optional[list[dict[int, float]]]]]:
        """What __call__ does for any batch: biases, masks, penalties, greedy rows and draws,
        logprobs (a batch of plain greedy rows gives the same tokens through greedy_tokens)."""
        raw = logits
        logits = with_logit_bias(logits, [s.sampling_params for s in seqs])
        if self.structured is not None:
            logits = self.structured.mask(logits, seqs)
        if any(s.sampling_params.has_penalties for s in seqs):
            logits = logits.clone()
            for i, s in enumerate(seqs):
                if s.sampling_params.has_penalties:
                    apply_penalties(logits[i], s.sampling_params, self._history(s, logits))
        tokens: list[list[int]] = [[] for _ in seqs]
        greedy = [i for i, s in enumerate(seqs) if s.sampling_params.is_greedy]
        if greedy:
            rows = logits if len(greedy) == len(seqs) else logits[greedy]  # (a list index copies: ~40 us)
            ids = rows.argmax(-1).tolist()
            for i, t in zip(greedy, ids):
                tokens[i] = [t] * seqs[i].num_samples
        rand = [i for i, s in enumerate(seqs) if not s.sampling_params.is_greedy]
        if rand:
            probs = filter_logits(logits[rand], [seqs[i].sampling_params for i in rand]).softmax(-1)
            for row, i in enumerate(rand):
                s = seqs[i]
                tokens[i] = self._draw(probs[row], s, len(s.output_token_ids), s.num_samples)
        if self.structured is not None:
            self.structured.accept(seqs, tokens)
        return tokens, [_logprobs(raw[i], tokens[i], s.sampling_params.logprobs)
                        for i, s in enumerate(seqs)]

    def verify(self, rows: torch.Tensor, seq: ScheduledSequence
               ) -> tuple[list[int], Optional[list[dict[int, float]]]]:
        """rows [k + 1, vocab]: the logits after the last input and after each of the k proposals.
        Returns the accepted proposals and one more token (a correction, or after all k a bonus).

        Row i settles output position start + i exactly as a plain step would: greedy takes the
        argmax, sampling draws with that position's random numbers (`draw_seed`). A proposal is
        accepted while it equals the row's token; the first row whose token differs gives the
        correction. So guesses decide how many positions a step settles, never which tokens:
        the output is plain decoding's, token for token, greedy or seeded, and a position
        settled again after a preemption (by a plain step, or with other guesses) gets the same
        token. (Rejection sampling, accepting d with min(1, p(d) / q(d)), accepts more often
        for a draft that differs from the target, but its tokens depend on the guesses, so a
        request's samples would change with batching and preemption.) The draft proposer draws
        its guesses with the target's key and positions, so it races the same random numbers and
        guesses what the target draws wherever their distributions agree."""
        params, spec = seq.sampling_params, seq.spec_token_ids
        filtered = with_logit_bias(rows, [params] * len(rows))
        filtered = filtered.clone() if filtered is rows else filtered
        if params.has_penalties:
            history = self._history(seq, rows)
            for i in range(len(rows)):
                apply_penalties(filtered[i], params, history.with_tokens(spec[:i]))
        if params.is_greedy:
            targets = filtered.argmax(-1).tolist()
            n = next((i for i, (d, t) in enumerate(zip(spec, targets)) if d != t), len(spec))
            tokens = spec[:n] + [targets[n]]
        else:
            tokens = self._settle(filter_logits(filtered, [params] * len(rows)).softmax(-1), seq)
        lps = [_logprobs(rows[i], [t], params.logprobs) for i, t in enumerate(tokens)]
        return tokens, None if params.logprobs is None else [lp[0] for lp in lps if lp is not None]

    def _settle(self, probs: torch.Tensor, seq: ScheduledSequence) -> list[int]:
        """probs [k + 1, vocab] -> each row's own draw, up to the first that is not the guess."""
        start, spec = len(seq.output_token_ids), seq.spec_token_ids
        tokens: list[int] = []
        for i in range(len(spec) + 1):
            tokens += self._draw(probs[i], seq, start + i, 1)
            if i == len(spec) or tokens[i] != spec[i]:
                break
        return tokens


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits before the argmax (bias, penalties) and no
    logprobs to report: the token is the row's argmax and nothing else is asked."""
    return (params.is_greedy and not params.logit_bias and not params.has_penalties
            and params.logprobs is None)


@functools.lru_cache(maxsize=1)
def compiled_argmax() -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """layer_ops.argmax_rows where this CPU's build has it (AVX-512), else None."""
    ops = kernels.load("layer_ops")
    return getattr(ops, "argmax_rows", None) if ops is not None else None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first of tied maxima and a NaN first, as torch's max(-1).indices
    (which takes 0.8 ms on 64 x 49,152 fp32 logits, 2 threads, where argmax takes 2.0: its
    reduction is not vectorized). On CPU the AVX-512 build's kernel takes 0.23 ms (and 4 us for
    one row against 23)."""
    fast = compiled_argmax() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if fast is not None and logits.dim() == 2 and logits.shape[-1] > 0 and logits.stride(-1) == 1:
        return fast(logits)
    return logits.max(-1).indices


def greedy_tokens(logits: torch.Tensor, seqs: Sequence[ScheduledSequence]) -> list[list[int]]:
    """Each row's argmax (the first of tied maxima, as Sampler.general takes it), num_samples
    times: a plain greedy batch in one call and one list, whatever its size."""
    ids = argmax_rows(logits).tolist()
    return [[t] * s.num_samples for t, s in zip(ids, seqs)]


def _logprobs(row: torch.Tensor, chosen: list[int], k: Optional[int]) -> Optional[list[dict[int, float]]]:
    """Per sampled token: the k most likely ids, most likely first, then the sampled id when it
    is not among them (so a row holds k or k + 1 entries; raw model logprobs, before any bias,
    penalty or mask, as vLLM's default)."""
    if k is None:
        return None
    lp = row.log_softmax(-1)
    top = lp.topk(min(k, lp.shape[-1])) if k > 0 else None
    out = []
    for t in chosen:
        d = dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {}
        d.setdefault(t, float(lp[t]))
        out.append(d)
    return out
