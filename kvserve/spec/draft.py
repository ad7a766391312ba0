"""Draft-model proposals: a smaller model with the target's vocabulary runs its own engine (its
own paged cache, scheduler and runner) over a copy of each decoding request, generating k
tokens ahead; after the target verifies them, the draft's copy is rolled back to the tokens the
target kept (Scheduler.rollback: computed tokens down, trailing blocks freed), and continues.

    target tokens       t0 .. tn                       (tn not yet computed)
    draft copy          t0 .. tn d1 .. dk              proposals, drawn greedily or from q
    target keeps        t0 .. tn d1 .. da b            (a accepted, b its own next token)
    draft rolls back    t0 .. tn d1 .. da, appends b, and proposes again

A greedy request gets greedy guesses; a sampled one gets guesses drawn from the draft's own
distribution after the request's temperature and top-k/top-p/min-p, with the random numbers the
target draws that position with (the copy adopts the target's key, and the copy's output
positions are the target's): where the two distributions agree the draft guesses exactly the
target's token, and the target keeps a guess only when it is its own draw (Sampler.verify).
Requests with penalties are not guessed for (their distribution depends on the guesses
themselves).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.spec.base import Proposer

VOCAB_PROBE = "The quick brown fox jumps over the lazy dog. 0123456789 élan café naïve 🙂"


def check_same_vocabulary(target: Any, draft: Any) -> None:
    """A ValueError unless the draft reads and writes the target's token ids."""
    tc, dc = target.model_config, draft.model_config
    if tc.vocab_size != dc.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({dc.vocab_size} tokens) differs from the target's "
                         f"({tc.vocab_size}); a draft must share the target's tokenizer")
    if target.tokenizer is not None and draft.tokenizer is not None and \
            target.tokenizer.encode(VOCAB_PROBE) != draft.tokenizer.encode(VOCAB_PROBE):
        raise ValueError("the draft model's tokenizer splits text differently from the target's; "
                         "a draft must share the target's tokenizer")


class DraftProposer(Proposer):
    name = "draft"

    def __init__(self, engine: Any, target_key: Callable[[str], Optional[int]]) -> None:
        self.engine = engine  # an LLMEngine over the draft model
        self.target_key = target_key  # request -> the key its target draws with (Sampler.key)
        self.synced: dict[str, int] = {}  # request -> the target's length at the last proposal

    def propose(self, requests: Sequence[Request], k: int) -> None:
        scheduler = self.engine.scheduler
        wanted = {r.request_id: r for r in requests if not r.sampling_params.has_penalties}
        for rid in [rid for rid in scheduler.groups if rid not in wanted]:  # idle copies would run on
            self.engine.abort(rid)
            self.synced.pop(rid, None)
        start = {rid: self._sync(req, k) for rid, req in wanted.items()}
        while any(self._num_new(rid, start[rid]) < k for rid in wanted if rid in scheduler.requests):
            self.engine.step()
        for rid, req in wanted.items():
            copy = scheduler.requests.get(rid)
            # no copy: the draft could not hold it (its cache is too small), no guess
            req.spec_token_ids = [] if copy is None else copy.all_token_ids[start[rid]:start[rid] + k]
            req.spec_probs = None  # the target keeps a guess only where it is its own draw

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)
            self.synced.pop(rid, None)

    def _sync(self, req: Request, k: int) -> int:
        """Make the draft's copy hold the target's tokens; returns their number."""
        scheduler, tokens = self.engine.scheduler, req.all_token_ids
        copy = scheduler.requests.get(req.request_id)
        if copy is None or copy.status == RequestStatus.SWAPPED:
            if copy is not None:
                self.engine.abort(req.request_id)
            self._add(req, k)
        else:
            common = self.synced.get(req.request_id, 0)
            while common < min(copy.num_tokens, len(tokens)) and copy.all_token_ids[common] == tokens[common]:
                common += 1
            keep = max(common, copy.num_prompt_tokens + 0)
            scheduler.rollback(copy, min(copy.num_computed_tokens, keep - 1), keep - copy.num_prompt_tokens)
            if len(tokens) > keep:
                scheduler.extend(copy, tokens[keep:])
        self.synced[req.request_id] = len(tokens)
        return len(tokens)

    def _add(self, req: Request, k: int) -> None:
        p = req.sampling_params  # the copy runs ahead of the target by up to k guesses
        params = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                                seed=p.seed, max_tokens=p.max_tokens + k, ignore_eos=True)
        self.engine.add_request(req.request_id, req.prompt_token_ids, params)
        key = self.target_key(req.request_id)
        if key is not None:  # the copy races the target's random numbers
            self.engine.runner.sampler.adopt(req.request_id, key)
        copy = self.engine.scheduler.requests[req.request_id]
        if req.output_token_ids:
            self.engine.scheduler.extend(copy, list(req.output_token_ids))

    def _num_new(self, rid: str, start: int) -> int:
        copy = self.engine.scheduler.requests.get(rid)
        return 0 if copy is None else copy.num_tokens - start
