"""What the engine hands back to users: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # stop | length | abort | error
    stop_reason: Optional[str] = None  # the stop string or token id that matched
    logprobs: Optional[list[dict[int, float]]] = None
    delta: str = ""  # text added since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None  # beam search: the sum of the tokens' logprobs
    score: Optional[float] = None  # beam search: cumulative_logprob / length ** length_penalty

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_kv_blocks: int = 0  # blocks held at the last step (the request's cache footprint)
    kv_cache_bytes: int = 0
    num_spec_proposed: int = 0  # speculative tokens verified for it
    num_spec_accepted: int = 0  # of which accepted
    num_spec_steps: int = 0  # steps that verified guesses

    @property
    def spec_acceptance_rate(self) -> Optional[float]:
        return self.num_spec_accepted / self.num_spec_proposed if self.num_spec_proposed else None

    @property
    def mean_accepted_length(self) -> Optional[float]:
        """Guesses accepted per step that verified some (each such step also adds one token)."""
        return self.num_spec_accepted / self.num_spec_steps if self.num_spec_steps else None

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> Optional[float]:
        """Mean time per output token after the first."""
        if self.finish_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: Optional[str] = None
    # with SamplingParams(prompt_logprobs=k): per prompt token, {its id: logprob} plus the k most
    # likely ids; None for the first token (nothing precedes it), as vLLM returns them
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens


def coalesce(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output saying what two consecutive outputs of a request said: `later`, with each
    sample's delta (text and token ids) preceded by what `earlier` had not yet been read for. An
    output without samples (a request ended from outside the engine) stands as it is."""
    before = {c.index: c for c in earlier.outputs}
    merged = []
    for c in later.outputs:
        e = before.get(c.index)
        merged.append(c if e is None else dataclasses.replace(
            c, delta=e.delta + c.delta, delta_token_ids=e.delta_token_ids + c.delta_token_ids))
    return dataclasses.replace(later, outputs=merged) if later.outputs else later
