"""The dataclasses that cross component boundaries: Scheduler -> ModelRunner -> Scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvserve.core.kv_cache_manager import BlockCopies, TableUpdate
from kvserve.core.sampling_params import SamplingParams


@dataclass
class ScheduledSequence:
    """One request's share of a step: its next known tokens from start_position on, then any
    proposed tokens to verify. The runner keeps each request's block tables; `table_updates`
    carries only the entries that changed (per cache group), so nothing here grows with the
    context."""

    request_id: str
    input_token_ids: list[int]  # known tokens (prompt or output) whose K/V this step computes
    start_position: int  # == the request's num_computed_tokens: RoPE position of the first input
    table_updates: tuple[TableUpdate, ...]
    sampling_params: SamplingParams
    num_samples: int  # 0: a partial prefill chunk, no token is sampled; n > 1: the fork point
    prompt_token_ids: list[int] = field(default_factory=list)  # the request's own lists, not copies
    output_token_ids: list[int] = field(default_factory=list)
    seed: Optional[int] = None
    spec_token_ids: list[int] = field(default_factory=list)  # proposals fed after the inputs
    spec_probs: Any = None  # the proposer's distributions [k, vocab] they were drawn from (None: point guesses)
    num_logit_rows: int = 0  # the last rows whose logits the runner returns (ModelRunnerOutput.logits)

    @property
    def num_tokens(self) -> int:
        """Rows this sequence adds to the batch: its inputs and its proposals."""
        return len(self.input_token_ids) + len(self.spec_token_ids)

    @property
    def context_len(self) -> int:
        """Tokens this sequence attends to after the step: the cache plus its rows."""
        return self.start_position + self.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    copies: BlockCopies
    finished_request_ids: list[str]
    num_preempted: int = 0
    # (request id, block ids) whose K/V arrives from another engine: written before the forward
    kv_loads: list[tuple[str, list[int]]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """What a step produced, by request id.

    sampled_token_ids: the tokens the request gains, in order: one, or with proposals the
        accepted ones and one more (the first token that was not proposed).
    forked_token_ids: at an n > 1 fork point, the first token of each further sample.
    logits: the rows a sequence asked for (num_logit_rows), as the runner's tensor [rows, vocab].
    """

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    forked_token_ids: dict[str, list[int]] = field(default_factory=dict)
    forked_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    logits: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preempted_waiting: int
    num_preemptions: int
    kv_usage: float
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_hit_rate: float
    num_reserved_slots: int
    num_used_slots: int

    @property
    def fragmentation_slots(self) -> int:
        """Internal fragmentation: slots allocated to running requests that hold no token."""
        return self.num_reserved_slots - self.num_used_slots
