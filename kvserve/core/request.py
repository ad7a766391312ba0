"""Request: one sequence's tokens, progress through the cache, and life cycle.

There are no prefill and decode phases: `num_computed_tokens` (tokens whose K/V is in the cache)
catches up with `num_tokens` (prompt + output). A fresh request has a long way to go (its
prompt, possibly in chunks); a decoding one is always one behind (its last sampled token).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

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


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    """One sequence. Its tokens live in `all_token_ids` (prompt, then output), kept as one list
    that grows in place, so reading it costs nothing per step; `output_token_ids` is the output
    part of it, kept beside it. Change the output only through `append_token` and
    `truncate_output`, which keep the two in step."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower values are served first, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: Optional[str] = None
    group: Optional["RequestGroup"] = None  # set by RequestGroup; every request has one
    sample_index: int = 0  # its place in the group

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
    spec_token_ids: list[int] = field(default_factory=list)  # proposals the next step verifies
    spec_probs: Any = None  # their proposer's distributions (a tensor; None: point guesses)
    num_spec_proposed: int = 0  # proposals verified so far
    num_spec_accepted: int = 0  # of which accepted
    num_spec_steps: int = 0  # steps that verified proposals
    num_truncations: int = 0  # output taken back this many times (readers of the output re-read)
    # prompt tokens whose K/V another engine computed (disaggregated prefill): loaded into the
    # request's blocks on admission instead of computed; 0 once loaded
    num_external_tokens: int = 0
    all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        if self.group is None:
            RequestGroup(self.request_id, [self])

    @property
    def group_id(self) -> str:
        assert self.group is not None
        return self.group.group_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def cache_keys(self) -> tuple[object, ...]:
        """What names this request's blocks beside the model's namespace: its cache_salt, and its
        LoRA adapter's id where it has one (K/V computed through an adapter is never shared with
        the base model or another adapter; a base request's keys are the salt alone)."""
        lora = self.sampling_params.lora_request
        return (self.cache_salt,) if lora is None else (self.cache_salt, f"lora:{lora.lora_int_id}:{lora.lora_name}")

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.is_finished else None

    def append_token(self, token_id: int, logprobs: Optional[dict[int, float]] = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep the first num_output_tokens output tokens (a rollback takes the rest back)."""
        if num_output_tokens < self.num_output_tokens:
            self.num_truncations += 1
        del self.output_token_ids[num_output_tokens:]
        del self.output_logprobs[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]

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


class RequestGroup:
    """The requests that answer one user request: its n samples, or its beams. Members share
    the prompt (and, through forks, blocks); the group is what a user aborts and what the
    output names. A plain request is a group of one."""

    def __init__(self, group_id: str, members: list[Request]) -> None:
        self.group_id = group_id
        self.members: list[Request] = []
        for member in members:
            self.add(member)

    def add(self, request: Request) -> None:
        request.group = self
        self.members.append(request)

    @property
    def first(self) -> Request:
        return self.members[0]

    @property
    def is_finished(self) -> bool:
        return all(m.is_finished for m in self.members)
