"""Sampling: logits [N, vocab] of the rows that sample -> token ids, one request per row.

Greedy rows take the argmax; the others go through penalties, temperature, top-k, top-p and
min-p (vectorized), then draw from their own torch.Generator so a seed reproduces whatever
else is in the batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvserve.core.outputs import ScheduledSequence
from kvserve.core.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """One row [vocab]: repetition over prompt and output; presence/frequency over output."""
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty,
                                   vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=device), minlength=logits.shape[-1])
        logits -= params.frequency_penalty * counts[:logits.shape[-1]].to(logits.dtype)
        logits -= params.presence_penalty * (counts[:logits.shape[-1]] > 0).to(logits.dtype)
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
        self._num_unseeded = 0

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)

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

    def __call__(self, logits: torch.Tensor, seqs: Sequence[ScheduledSequence]
                 ) -> tuple[list[list[int]], list[Optional[list[dict[int, float]]]]]:
        """logits [N, vocab] fp32, one row per sequence -> num_samples ids per sequence."""
        raw = logits
        if any(s.sampling_params.has_penalties for s in seqs):
            logits = logits.clone()
            for i, s in enumerate(seqs):
                if s.sampling_params.has_penalties:
                    apply_penalties(logits[i], s.sampling_params, s.prompt_token_ids, s.output_token_ids)
        tokens: list[list[int]] = [[] for _ in seqs]
        greedy = [i for i, s in enumerate(seqs) if s.sampling_params.is_greedy]
        if greedy:
            ids = logits[greedy].argmax(-1).tolist()
            for i, t in zip(greedy, ids):
                tokens[i] = [t] * seqs[i].num_samples
        rand = [i for i, s in enumerate(seqs) if not s.sampling_params.is_greedy]
        if rand:
            probs = filter_logits(logits[rand], [seqs[i].sampling_params for i in rand]).softmax(-1)
            for row, i in enumerate(rand):
                g = self._generator(seqs[i], probs.device)
                tokens[i] = torch.multinomial(probs[row], seqs[i].num_samples, replacement=True,
                                              generator=g).tolist()
        return tokens, [_logprobs(raw[i], tokens[i], s.sampling_params.logprobs)
                        for i, s in enumerate(seqs)]


def _logprobs(row: torch.Tensor, chosen: list[int], k: Optional[int]) -> Optional[list[dict[int, float]]]:
    """Per sampled token: {its id: logprob} plus the k most likely ids (raw model logprobs)."""
    if k is None:
        return None
    lp = row.log_softmax(-1)
    top = lp.topk(k) if k > 0 else None
    out = []
    for t in chosen:
        d = {t: float(lp[t])}
        if top is not None:
            d.update(zip(top.indices.tolist(), top.values.tolist()))
        out.append(d)
    return out
