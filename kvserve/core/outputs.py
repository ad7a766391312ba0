"""The dataclasses that cross component boundaries: Scheduler -> ModelRunner -> Scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvserve.core.kv_cache_manager import BlockCopies
from kvserve.core.sampling_params import SamplingParams


@dataclass
class ScheduledSequence:
    """One request's share of a step: its next tokens, starting at start_position."""

    request_id: str
    input_token_ids: list[int]
    start_position: int  # == the request's num_computed_tokens: RoPE position of the first input
    block_table: list[int]
    sampling_params: SamplingParams
    num_samples: int  # 0: a partial prefill chunk, no token is sampled; n > 1: the fork point
    prompt_token_ids: list[int] = field(default_factory=list)  # read by penalties
    output_token_ids: list[int] = field(default_factory=list)
    seed: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def context_len(self) -> int:
        """Tokens this sequence attends to after the step: the cache plus its inputs."""
        return self.start_position + len(self.input_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    copies: BlockCopies
    finished_request_ids: list[str]
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]]  # num_samples tokens per sampled request
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)


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
