"""Requests -> RequestOutputs: detokenization, stop strings, streaming deltas, metrics.

Text is decoded incrementally (IncrementalDetokenizer: a few tokens a step, whatever the
output's length) and streamed as deltas. A delta holds back a trailing replacement character
(an incomplete UTF-8 sequence) and any tail that could still grow into a stop string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.core.request import Request, RequestGroup
from kvserve.core.sampling_params import SamplingParams
from kvserve.tokenizer.base import Tokenizer


class IncrementalDetokenizer:
    """The text of a growing token list, as `tokenizer.decode(ids)` gives it, decoding only a
    window per call: the tokens added since the last complete character, after the previous
    window (`prefix_offset:read_offset`) as context, so tokenizers that drop a leading space or
    merge bytes across tokens decode the new tokens exactly as in the whole text:

        committed text  |  decode(ids[prefix:]) minus decode(ids[prefix:read])  -> new text

    New text that ends in an incomplete character stays pending (shown, not committed) until the
    next token completes it. Where a window disagrees with its prefix (a normalizing decoder),
    or the ids were cut back (a rollback), it decodes the whole list again."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.committed = ""
        self.prefix_offset = self.read_offset = 0
        self.num_truncations = 0

    def text(self, ids: list[int], num_truncations: int = 0) -> str:
        if num_truncations != self.num_truncations or len(ids) < self.read_offset:
            self.__init__(self.tokenizer)  # type: ignore[misc]
            self.num_truncations = num_truncations
        decode = self.tokenizer.decode
        prefix = decode(ids[self.prefix_offset:self.read_offset]) if self.read_offset > self.prefix_offset else ""
        window = decode(ids[self.prefix_offset:])
        if not window.startswith(prefix):
            self.committed, self.prefix_offset, self.read_offset = decode(ids), len(ids), len(ids)
            return self.committed
        new = window[len(prefix):]
        if new and not new.endswith("\ufffd"):
            self.committed += new
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return self.committed
        return self.committed + new


@dataclass
class SampleState:
    index: int
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Optional[str] = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, float]]] = None
    detokenizer: Optional[IncrementalDetokenizer] = None
    cumulative_logprob: Optional[float] = None
    score: Optional[float] = None


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    group: RequestGroup
    samples: dict[int, SampleState] = field(default_factory=dict)
    error: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    beams_done: bool = False

    @property
    def finished(self) -> bool:
        """Every member of the request's group (n samples, or more after forks) has ended; for
        beam search, the search has ended (its members come and go as beams) or failed."""
        if self.params.use_beam_search:
            return self.beams_done or (self.error is not None and self.group.is_finished)
        return len(self.samples) == len(self.group.members) and all(
            s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer: Optional[Tokenizer]) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, req: Request, prompt: Optional[str]) -> None:
        self.states[req.request_id] = RequestState(
            req.request_id, prompt, req.prompt_token_ids, req.sampling_params,
            RequestMetrics(req.arrival_time), req.group,  # type: ignore[arg-type]
            prompt_logprobs=None if req.sampling_params.prompt_logprobs is None else [None])

    def add_prompt_logprobs(self, request_id: str, start: int, logprobs: list[dict[int, float]]) -> None:
        """Logprobs of prompt tokens start + 1 .. (rows from position start on); positions already
        recorded (a preempted request computes its prompt again) are skipped."""
        state = self.states.get(request_id)
        if state is None or state.prompt_logprobs is None:
            return
        done = len(state.prompt_logprobs)
        state.prompt_logprobs += logprobs[max(done - 1 - start, 0):]

    def finish_beams(self, group_id: str, hypotheses: list[Any]) -> None:
        """A beam search ended: its best hypotheses (kvserve.engine.beam_search) are the samples."""
        state = self.states.get(group_id)
        if state is None:
            return
        for i, h in enumerate(hypotheses):
            text = self.tokenizer.decode(h.token_ids) if self.tokenizer is not None else ""
            state.samples[i] = SampleState(i, text, token_ids=list(h.token_ids),
                                           finish_reason="stop" if h.ends_with_eos else "length",
                                           cumulative_logprob=h.cumulative_logprob, score=h.score)
        state.beams_done = True
        first = state.group.first
        m = state.metrics
        m.first_scheduled_time, m.first_token_time = first.first_scheduled_time, first.first_token_time
        m.num_cached_tokens, m.finish_time = first.num_cached_tokens or 0, time.monotonic()

    def process(self, req: Request) -> Optional[str]:
        """Fold a request's new tokens into its sample; returns the stop string it hit, if any."""
        state = self.states.get(req.group_id)
        if state is None or state.params.use_beam_search:
            return None
        sample = state.samples.setdefault(req.sample_index, SampleState(req.sample_index))
        sample.token_ids = req.output_token_ids
        if req.sampling_params.logprobs is not None:
            sample.logprobs = req.output_logprobs
        if self.tokenizer is not None:
            if sample.detokenizer is None:
                sample.detokenizer = IncrementalDetokenizer(self.tokenizer)
            sample.text = sample.detokenizer.text(req.output_token_ids, req.num_truncations)
        hit = self._find_stop(sample, req.sampling_params)
        if req.is_finished and sample.finish_reason is None:
            sample.finish_reason, sample.stop_reason = req.finish_reason, req.stop_reason
            state.error = state.error or req.error
        self._update_metrics(state.metrics, req)
        return hit

    def finish_sample(self, req: Request, reason: str) -> None:
        state = self.states.get(req.group_id)
        if state is not None:
            sample = state.samples.setdefault(req.sample_index, SampleState(req.sample_index))
            if sample.finish_reason is None:
                sample.finish_reason = reason
            self._update_metrics(state.metrics, req)

    def output(self, request_id: str) -> Optional[RequestOutput]:
        """The request's current output with deltas since the last call; finished ones are
        forgotten after this."""
        state = self.states.get(request_id)
        if state is None:
            return None
        completions = [self._completion(s, state.params) for _, s in sorted(state.samples.items())]
        out = RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                            state.finished, state.metrics, state.error, state.prompt_logprobs)
        if state.finished:
            del self.states[request_id]
        return out

    def _completion(self, s: SampleState, params: SamplingParams) -> CompletionOutput:
        visible = len(s.text) if s.finish_reason else _stable_length(s.text, params.stop)
        visible = max(visible, s.num_sent_chars)
        delta = s.text[s.num_sent_chars:visible]
        delta_ids = s.token_ids[s.num_sent_tokens:]
        s.num_sent_chars, s.num_sent_tokens = visible, len(s.token_ids)
        return CompletionOutput(s.index, s.text, list(s.token_ids), s.finish_reason, s.stop_reason,
                                s.logprobs, delta, delta_ids, s.cumulative_logprob, s.score)

    def _find_stop(self, s: SampleState, params: SamplingParams) -> Optional[str]:
        if not params.stop or s.finish_reason is not None:
            return None
        start = max(0, s.num_sent_chars - max(len(x) for x in params.stop))
        best: Optional[tuple[int, str]] = None
        for stop in params.stop:
            i = s.text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        s.text = s.text[:i + len(stop)] if params.include_stop_str_in_output else s.text[:i]
        s.finish_reason, s.stop_reason = "stop", stop
        return stop

    @staticmethod
    def _update_metrics(m: RequestMetrics, req: Request) -> None:
        if req.sample_index:
            return  # samples of n > 1 share the parent's timeline
        m.first_scheduled_time = req.first_scheduled_time
        m.first_token_time = m.first_token_time or req.first_token_time
        m.num_cached_tokens = req.num_cached_tokens or 0
        m.num_preemptions = req.num_preemptions
        m.num_spec_proposed, m.num_spec_accepted = req.num_spec_proposed, req.num_spec_accepted
        m.num_spec_steps = req.num_spec_steps
        if req.is_finished:
            m.finish_time = req.finish_time or time.monotonic()


def _stable_length(text: str, stops: tuple[str, ...]) -> int:
    """Characters safe to stream: no half-decoded character, no possible stop-string start."""
    n = len(text)
    while n and text[n - 1] == "\ufffd":
        n -= 1
    for stop in stops:
        for k in range(min(len(stop) - 1, n), 0, -1):
            if text[:n].endswith(stop[:k]):
                n -= k
                break
    return n
