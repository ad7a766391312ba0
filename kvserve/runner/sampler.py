"""Sampling: logits [N, vocab] of the rows that sample -> token ids, one request per row.

Greedy rows take the argmax; the others go through penalties, temperature, top-k, top-p and
min-p (vectorized), then draw from their own torch.Generator so a seed reproduces whatever
else is in the batch.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch

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


class Sampler:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}
        self.histories: dict[str, TokenHistory] = {}
        self._num_unseeded = 0
        self.structured: Optional[Any] = None  # StructuredOutputs, where the model's tokenizer can drive one

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)
            self.histories.pop(rid, None)
        if self.structured is not None:
            self.structured.forget(request_ids)

    def adopt(self, request_id: str, state: torch.Tensor) -> None:
        """Continue a request's random draws from a state saved elsewhere (another engine drew
        its first token)."""
        g = torch.Generator()
        g.set_state(state)
        self.generators[request_id] = g

    def state(self, request_id: str) -> Optional[torch.Tensor]:
        """The request's random state (None: it has no generator of its own yet)."""
        g = self.generators.get(request_id)
        return None if g is None else g.get_state()

    def save(self, request_ids: Sequence[str]) -> tuple[dict[str, Optional[torch.Tensor]], int, Any]:
        """The random (and grammar) state of these requests, to draw their step again (`restore`)."""
        states = {rid: (g.get_state() if (g := self.generators.get(rid)) is not None else None) for rid in request_ids}
        return states, self._num_unseeded, self.structured.save(request_ids) if self.structured else None

    def restore(self, saved: tuple[dict[str, Optional[torch.Tensor]], int, Any]) -> None:
        states, self._num_unseeded, matchers = saved
        if self.structured is not None:
            self.structured.restore(matchers)
        for rid, state in states.items():
            if state is None:
                self.generators.pop(rid, None)
            else:
                self.generators[rid].set_state(state)

    def _generator(self, seq: ScheduledSequence, device: torch.device) -> torch.Generator:
        g = self.generators.get(seq.request_id)
        if g is None:
            g = torch.Generator(device=device)
            if seq.seed is not None:
                g.manual_seed(seq.seed)
            else:  # reproducible from the engine seed and arrival order
                g.manual_seed(self.seed * 1_000_003 + self._num_unseeded)
                self._num_unseeded += 1
            self.generators[seq.request_id] = g
        return g

    def _history(self, seq: ScheduledSequence, logits: torch.Tensor) -> TokenHistory:
        h = self.histories.get(seq.request_id)
        if h is None:
            h = self.histories[seq.request_id] = TokenHistory(logits.shape[-1], seq.prompt_token_ids, logits.device)
        h.catch_up(seq.output_token_ids)
        return h

    def __call__(self, logits: torch.Tensor, seqs: Sequence[ScheduledSequence]
                 ) -> tuple[list[list[int]], list[Optional[list[dict[int, float]]]]]:
        """logits [N, vocab] fp32, one row per sequence -> num_samples ids per sequence."""
        raw = logits
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
                g = self._generator(seqs[i], probs.device)
                tokens[i] = torch.multinomial(probs[row], seqs[i].num_samples, replacement=True,
                                              generator=g).tolist()
        if self.structured is not None:
            self.structured.accept(seqs, tokens)
        return tokens, [_logprobs(raw[i], tokens[i], s.sampling_params.logprobs)
                        for i, s in enumerate(seqs)]

    def verify(self, rows: torch.Tensor, seq: ScheduledSequence
               ) -> tuple[list[int], Optional[list[dict[int, float]]]]:
        """rows [k + 1, vocab]: the logits after the last input and after each of the k proposals.
        Returns the accepted proposals and one more token (a correction, or after all k a bonus).

        Greedy: a proposal is accepted while it is the argmax, so the output is exactly what
        plain greedy decoding gives. Sampling (speculative sampling): proposal d, drawn by the
        proposer from q, is accepted with probability min(1, p(d) / q(d)); on rejection the token
        is drawn from normalize(max(0, p - q)); after k acceptances one more comes from p. Every
        emitted token is then distributed exactly as p. q is the draft's distribution
        (seq.spec_probs), or for proposals that are point guesses (n-gram lookup) 1 on d."""
        params, spec = seq.sampling_params, seq.spec_token_ids
        filtered = rows.clone()
        if params.has_penalties:
            history = self._history(seq, rows)
            for i in range(len(rows)):
                apply_penalties(filtered[i], params, history.with_tokens(spec[:i]))
        if params.is_greedy:
            targets = filtered.argmax(-1).tolist()
            n = next((i for i, (d, t) in enumerate(zip(spec, targets)) if d != t), len(spec))
            tokens = spec[:n] + [targets[n]]
        else:
            tokens = self._rejection_sample(filter_logits(filtered, [params] * len(rows)).softmax(-1), seq)
        lps = [_logprobs(rows[i], [t], params.logprobs) for i, t in enumerate(tokens)]
        return tokens, None if params.logprobs is None else [lp[0] for lp in lps if lp is not None]

    def _rejection_sample(self, probs: torch.Tensor, seq: ScheduledSequence) -> list[int]:
        g = self._generator(seq, probs.device)
        spec, q = seq.spec_token_ids, seq.spec_probs
        for i, d in enumerate(spec):
            q_d = 1.0 if q is None else float(q[i, d])
            if q_d <= 0 or torch.rand((), generator=g, device=probs.device).item() * q_d < probs[i, d].item():
                continue  # (q never proposes what it gives no mass; if it did, p / q is infinite)
            residual = probs[i].clone()
            if q is None:
                residual[d] = 0
            else:
                residual = (residual - q[i].to(residual.device)).clamp_min_(0)
            if residual.sum() > 0:  # else p <= q nowhere exceeds: d stays accepted
                return spec[:i] + [int(torch.multinomial(residual, 1, generator=g))]
        return spec + [int(torch.multinomial(probs[len(spec)], 1, generator=g))]


def _logprobs(row: torch.Tensor, chosen: list[int], k: Optional[int]) -> Optional[list[dict[int, float]]]:
    """Per sampled token: {its id: logprob} plus the k most likely ids (raw model logprobs)."""
    if k is None:
        return None
    lp = row.log_softmax(-1)
    top = lp.topk(min(k, lp.shape[-1])) if k > 0 else None
    out = []
    for t in chosen:
        d = {t: float(lp[t])}
        if top is not None:
            d.update(zip(top.indices.tolist(), top.values.tolist()))
        out.append(d)
    return out
