"""Request: one sequence's tokens, progress through the cache, and life cycle.

There are no prefill and decode phases: `num_computed_tokens` (tokens whose K/V is in the cache)
catches up with `num_tokens` (prompt + output). A fresh request has a long way to go (its
prompt, possibly in chunks); a decoding one is always one behind (its last sampled token).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from kvserve.core.block_hash import BlockHash
from kvserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute: back in the waiting queue, blocks freed
    SWAPPED = "swapped"  # swap: blocks copied to the CPU pool, waiting to come back
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower values are served first, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: Optional[str] = None
    parent_id: Optional[str] = None  # set on the extra samples of an n > 1 request
    sample_index: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: Optional[int] = None  # prefix-cache hits at first admission
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Optional[str] = None  # the stop string or token that ended it
    error: Optional[str] = None
    num_preemptions: int = 0
    num_kv_blocks: int = 0  # blocks held when it finished
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.is_finished else None

    def append_token(self, token_id: int, logprobs: Optional[dict[int, float]] = None) -> None:
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def check_stop(self, max_model_len: int) -> Optional[RequestStatus]:
        """The finished status the newest token causes, if any (stop strings are the engine's)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = str(last)
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
