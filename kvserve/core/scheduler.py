"""Scheduler: which requests run this step and how many of their tokens, within a token budget.

Iteration-level (continuous) batching with no prefill/decode phases: every request simply
has tokens not yet computed. Running requests are served first (in policy order), each taking
min(tokens left, budget left, prefill chunk) tokens; then waiting requests are admitted while
seats, budget and blocks allow. When blocks run out, the policy's worst running request is
preempted (recomputed later or swapped to the CPU pool).
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import Callable, Optional

from kvserve.config import SchedulerConfig
from kvserve.core.block_math import num_blocks_for
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.outputs import (ModelRunnerOutput, ScheduledSequence, SchedulerOutput,
                                  SchedulerStats)
from kvserve.core.request import Request, RequestStatus

PolicyKey = tuple[int, float, int]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by policy key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._order: dict[str, int] = {}
        self._counter = itertools.count()
        self._finished_ids: list[str] = []
        self._step_preemptions = 0
        self.key: Callable[[Request], PolicyKey] = (
            self._priority_key if config.policy == "priority" else self._fcfs_key)

    # ---- policy ----
    def _fcfs_key(self, req: Request) -> PolicyKey:
        return (0, req.arrival_time, self._order[req.request_id])

    def _priority_key(self, req: Request) -> PolicyKey:
        return (req.priority, req.arrival_time, self._order[req.request_id])

    # ---- requests in and out ----
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._order[req.request_id] = next(self._counter)
        bisect.insort(self.waiting, req, key=self.key)

    def finish_request(self, request_id: str, status: RequestStatus) -> Optional[Request]:
        """End a request (abort, stop string, error) and free its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        req.finish_time = time.monotonic()
        req.num_kv_blocks = len(self.kv.block_table(request_id))
        self.kv.free(req)
        self._order.pop(request_id, None)
        self._finished_ids.append(request_id)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ----
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        self._step_preemptions = 0
        self._preempt_for_priority()  # deliberate: the seat goes to the waiting request now
        num_priority_preemptions = self._step_preemptions
        # Decodes first, then prefill chunks, each in policy order: a long prompt never
        # stalls the running decodes behind it.
        for req in sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1,
                                                       self.key(r))):
            if budget == 0:
                break
            if req not in self.running:
                continue  # preempted to make room for an earlier one
            num_new = self._num_new_tokens(req, req.num_computed_tokens, budget)
            if self._allocate_or_preempt(req, num_new, scheduled):
                scheduled.append(self._scheduled(req, num_new))
                budget -= num_new
        if self._step_preemptions == num_priority_preemptions:  # admitting while short of blocks would thrash
            self._admit(scheduled, budget)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled, self.kv.take_copies(), finished, self._step_preemptions)

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled ones, finish what stopped. Returns the
        requests that gained a token or finished (forked samples included)."""
        touched: list[Request] = []
        now = time.monotonic()
        for seq in out.scheduled:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue  # aborted while the step ran
            req.num_computed_tokens += seq.num_tokens
            if not seq.num_samples:
                continue
            tokens = result.sampled_token_ids[seq.request_id]
            logprobs = result.logprobs.get(seq.request_id, [None] * len(tokens))
            samples = [req] + self._fork(req, len(tokens) - 1)
            for sample, token, lp in zip(samples, tokens, logprobs):
                self._append(sample, token, lp, now)
                touched.append(sample)
        return touched

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_preempted_waiting=sum(r.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
                                      for r in self.waiting),
            num_preemptions=self.num_preemptions, kv_usage=self.kv.usage,
            num_blocks=pool.num_blocks, num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks, prefix_hit_rate=self.kv.prefix_hit_rate,
            num_reserved_slots=sum(self.kv.num_reserved_slots(r.request_id) for r in self.running),
            num_used_slots=sum(r.num_computed_tokens for r in self.running))

    # ---- helpers ----
    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        num_new = min(req.num_tokens - num_computed, budget)
        if self.config.max_prefill_chunk is not None:
            num_new = min(num_new, self.config.max_prefill_chunk)
        return max(num_new, 1) if budget > 0 else 0

    def _allocate_or_preempt(self, req: Request, num_new: int,
                             scheduled: list[ScheduledSequence]) -> bool:
        """Allocate for req, preempting the worst running requests not yet scheduled this step
        until it fits. False if req itself had to go."""
        taken = {s.request_id for s in scheduled}
        while not self.kv.allocate_slots(req, num_new):
            victim = max((r for r in self.running if r.request_id not in taken), key=self.key)
            if victim is req and len(self.running) == 1:
                self._fail(req, "the KV cache is too small to hold this sequence alone")
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _admit(self, scheduled: list[ScheduledSequence], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.status == RequestStatus.SWAPPED:
                num_new = self._num_new_tokens(req, req.num_computed_tokens, budget)
                if not self.kv.swap_in(req, num_new):
                    break
            else:
                cached_blocks, num_cached = self.kv.find_cached_prefix(req)
                num_new = self._num_new_tokens(req, num_cached, budget)
                if not self.kv.allocate_slots(req, num_new, cached_blocks):
                    break
                self._record_admission(req, num_cached)
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new

    def _record_admission(self, req: Request, num_cached: int) -> None:
        req.num_computed_tokens = num_cached
        if req.num_cached_tokens is None:  # first admission: count toward the hit rate
            req.num_cached_tokens = num_cached
            req.first_scheduled_time = time.monotonic()
            self.kv.record_prefix_query(req.num_tokens, num_cached)

    def _preempt_for_priority(self) -> None:
        """Under the priority policy, a waiting request better than the worst running one takes
        its seat (or its blocks) when either is short."""
        if self.config.policy != "priority":
            return
        while self.waiting and self.running:
            best, worst = self.waiting[0], max(self.running, key=self.key)
            if self.key(best) >= self.key(worst):
                return
            first_chunk = min(best.num_tokens, self.config.max_num_batched_tokens)
            needs_blocks = not self.kv.pool.can_take(num_blocks_for(first_chunk, self.kv.block_size))
            if len(self.running) < self.config.max_num_seqs and not needs_blocks:
                return
            self._preempt(worst)

    def _preempt(self, victim: Request) -> None:
        """Take the victim (the last in self.running) out and queue it to resume."""
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._step_preemptions += 1
        if self.config.preemption_mode == "swap" and self.kv.swap_out(victim):
            victim.status = RequestStatus.SWAPPED
        else:  # recompute: blocks go back with their hashes, so re-prefill can hit them
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, victim, key=self.key)

    def _fail(self, req: Request, message: str) -> None:
        req.error = message
        self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)

    def _scheduled(self, req: Request, num_new: int) -> ScheduledSequence:
        start = req.num_computed_tokens
        done = start + num_new == req.num_tokens
        params = req.sampling_params
        num_samples = 0
        if done:
            is_fork_point = params.n > 1 and req.parent_id is None and req.num_output_tokens == 0
            num_samples = params.n if is_fork_point else 1
        return ScheduledSequence(
            req.request_id, req.all_token_ids[start:start + num_new], start,
            list(self.kv.block_table(req.request_id)), params, num_samples,
            req.prompt_token_ids, req.output_token_ids,
            None if params.seed is None else params.seed + req.sample_index)

    def _fork(self, parent: Request, num_children: int) -> list[Request]:
        children = []
        for i in range(1, num_children + 1):
            child = Request(f"{parent.request_id}#{i}", parent.prompt_token_ids,
                            parent.sampling_params, parent.eos_token_ids, parent.priority,
                            parent.arrival_time, parent.cache_salt, parent.request_id, i,
                            output_token_ids=list(parent.output_token_ids),
                            num_computed_tokens=parent.num_computed_tokens,
                            num_cached_tokens=parent.num_cached_tokens,
                            status=RequestStatus.RUNNING,
                            first_scheduled_time=parent.first_scheduled_time)
            self.kv.fork(parent, child)
            self.requests[child.request_id] = child
            self._order[child.request_id] = next(self._counter)
            self.running.append(child)
            children.append(child)
        return children

    def _append(self, req: Request, token: int, logprobs: Optional[dict[int, float]],
                now: float) -> None:
        req.append_token(token, logprobs)
        if req.first_token_time is None:
            req.first_token_time = now
        status = req.check_stop(self.max_model_len)
        if status is not None:
            self.finish_request(req.request_id, status)
