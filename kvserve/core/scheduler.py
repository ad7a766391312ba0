"""Scheduler: which requests run this step and how many of their tokens, within a token budget.

Iteration-level (continuous) batching with no prefill/decode phases: every request simply
has tokens not yet computed. Running requests are served first (in policy order), each taking
min(tokens left, budget left, prefill chunk) tokens, plus any proposed tokens to verify; then
waiting requests are admitted while seats, budget and blocks allow. When blocks run out, the
policy's worst running request is preempted (recomputed later or swapped to the CPU pool).
The beams of one request are a gang: beam search advances them only together, so they are
scheduled, preempted and admitted together, and admitted only when the group's worst case fits
the free pool. Where a window lets a shorter chunk hold fewer blocks, a prompt takes the chunk
that fits.

Besides the step (`schedule`, `update`) it has the verbs that change a request's shape between
steps: `fork` (new members of its group sharing its blocks) and `rollback` (take back computed
tokens and output, freeing trailing blocks). Nothing here walks a request's context: the work
of a step grows with the number of requests, not with their length.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter
from typing import Callable, Optional

from kvserve.config import SchedulerConfig
from kvserve.core.block_math import num_blocks_for
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.observers import Observers
from kvserve.core.preemption import PreemptionCosts, Victim, make_preemption_mode
from kvserve.core.outputs import (ModelRunnerOutput, ScheduledSequence, SchedulerOutput,
                                  SchedulerStats)
from kvserve.core.request import Request, RequestGroup, RequestStatus
from kvserve.core.sampling_params import SamplingParams

PolicyKey = tuple[int, float, int]


def runs_as_gang(req: Request) -> bool:
    """Whether req's group must run whole in every step: beam search picks the next beams from
    all their rows at once (n samples go their own ways)."""
    return req.sampling_params.use_beam_search


def gang_of(req: Request) -> list[Request]:
    """The requests that run in the same step as req: every unfinished beam of its group, or
    req alone."""
    if not runs_as_gang(req):
        return [req]
    assert req.group is not None
    return [m for m in req.group.members if not m.is_finished]


def group_width(params: SamplingParams) -> int:
    """Sequences one request may run at once: its n samples, or its beams."""
    return max(params.n, params.beam_width or 0)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, RequestGroup] = {}  # unfinished groups by group id
        self.waiting: list[Request] = []  # kept sorted by policy key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._order: dict[str, int] = {}
        self._counter = itertools.count()
        self._finished_ids: list[str] = []
        self._loads: list[tuple[str, list[int]]] = []  # this step's handed-over K/V to write
        # called with a request about to end, before its blocks go back (their K/V is still
        # whole until the next step runs): what a prefill engine hands over is read here
        self.on_release: Observers[[Request]] = Observers()
        self._step_preemptions = 0
        self._failed: list[Request] = []  # ended with an error inside the scheduler, for the engine to report
        self.paused: set[str] = set()  # groups held out of the steps (pause, resume)
        # swap or recompute, per victim; the engine feeds the costs its measurements
        self.preemption = make_preemption_mode(config.preemption_mode, PreemptionCosts())
        self.preemption_choices: Counter[tuple[str, str]] = Counter()  # (swap | recompute, reason)
        self.key: Callable[[Request], PolicyKey] = (
            self._priority_key if config.policy == "priority" else self._fcfs_key)

    # ---- policy ----
    def _fcfs_key(self, req: Request) -> PolicyKey:
        return (0, req.arrival_time, self._order[req.request_id])

    def _priority_key(self, req: Request) -> PolicyKey:
        return (req.priority, req.arrival_time, self._order[req.request_id])

    # ---- requests in and out ----
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests or req.group_id in self.groups:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.groups[req.group_id] = req.group  # type: ignore[assignment]
        self._register(req)
        bisect.insort(self.waiting, req, key=self.key)

    def finish_request(self, request_id: str, status: RequestStatus) -> Optional[Request]:
        """End a request (abort, stop string, error) and free its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.finish_time = time.monotonic()
        req.num_kv_blocks = self.kv.num_held_blocks(request_id)
        if status == RequestStatus.FINISHED_ERROR:
            self.kv.forget_own_hashes(req)
        else:
            self.on_release(req)
        self.kv.free(req)
        self._order.pop(request_id, None)
        self._finished_ids.append(request_id)
        if req.group is not None and req.group.is_finished:
            self.groups.pop(req.group_id, None)
            self.paused.discard(req.group_id)
        return req

    def finish_group(self, group_id: str, status: RequestStatus) -> list[Request]:
        """End every unfinished member of a group (an abort of the user's request)."""
        group = self.groups.get(group_id)
        members = [] if group is None else [m for m in group.members if not m.is_finished]
        return [r for m in members if (r := self.finish_request(m.request_id, status)) is not None]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_runnable(self) -> bool:
        """Whether a step could compute anything: some unfinished request is not paused."""
        return any(r.group_id not in self.paused for r in self.requests.values())

    # ---- pausing: a group whose reader has fallen behind ----
    def pause(self, group_id: str) -> bool:
        """Hold a group out of the steps until resume: its running members keep their blocks but
        compute nothing (and are the first to give their blocks up when another request needs
        them), its waiting members are not admitted. So the output nobody reads stops growing.
        False: no such unfinished group."""
        if group_id not in self.groups:
            return False
        self.paused.add(group_id)
        return True

    def resume(self, group_id: str) -> None:
        """Let a paused group run again (from where it was; preempted meanwhile, it is recomputed
        or swapped in as any preempted request)."""
        self.paused.discard(group_id)

    def is_paused(self, req: Request) -> bool:
        return req.group_id in self.paused

    # ---- verbs between steps ----
    def fork(self, parent: Request, num_children: int) -> list[Request]:
        """num_children new members of the parent's group, each a copy of the parent at this
        point (tokens, computed tokens, shared blocks); the first write into a shared partial
        block copies it. Works at any step of a running or waiting request."""
        if parent.status not in (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED):
            raise ValueError(f"cannot fork request {parent.request_id!r} while it is {parent.status.value}")
        group = parent.group
        assert group is not None
        children = []
        for _ in range(num_children):
            child = Request(f"{group.group_id}#{len(group.members)}", parent.prompt_token_ids,
                            parent.sampling_params, parent.eos_token_ids, parent.priority,
                            parent.arrival_time, parent.cache_salt, group, len(group.members),
                            output_token_ids=list(parent.output_token_ids),
                            output_logprobs=list(parent.output_logprobs),
                            num_computed_tokens=parent.num_computed_tokens,
                            num_cached_tokens=parent.num_cached_tokens, status=parent.status,
                            first_scheduled_time=parent.first_scheduled_time,
                            first_token_time=parent.first_token_time)
            group.add(child)
            self._register(child)
            if parent.status == RequestStatus.RUNNING:
                self.kv.fork(parent, child)
                self.running.append(child)
            else:
                bisect.insort(self.waiting, child, key=self.key)
            children.append(child)
        return children

    def rollback(self, req: Request, num_computed_tokens: int, num_output_tokens: Optional[int] = None) -> None:
        """Take tokens back: keep num_output_tokens output tokens (default: all) and the K/V of
        only num_computed_tokens (fewer than the tokens kept, so one is left to compute). The
        blocks past them go back to the pool; none of them stays registered for this request.
        Where a sliding window already gave back blocks the next query would read, the request
        computes its tokens again from the start (prefix caching serves what it can)."""
        if req.status not in (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED):
            raise ValueError(f"cannot roll back request {req.request_id!r} while it is {req.status.value}")
        if num_output_tokens is not None:
            if not 0 <= num_output_tokens <= req.num_output_tokens:
                raise ValueError(f"cannot keep {num_output_tokens} of {req.num_output_tokens} output tokens")
            req.truncate_output(num_output_tokens)
        if not 0 <= num_computed_tokens < req.num_tokens or num_computed_tokens > req.num_computed_tokens:
            raise ValueError(f"cannot roll {req.request_id!r} back to {num_computed_tokens} computed tokens "
                             f"(it has {req.num_computed_tokens} of {req.num_tokens})")
        if not self.kv.holds_window_of(req, num_computed_tokens):  # a sliding window gave those blocks back
            self.kv.free(req)
            num_computed_tokens = 0
        req.num_computed_tokens = num_computed_tokens
        req.spec_token_ids, req.spec_probs = [], None
        self.kv.trim(req, num_computed_tokens)

    def extend(self, req: Request, tokens: list[int], logprobs: Optional[list[dict[int, float]]] = None) -> None:
        """Append tokens chosen outside the step (a beam's next token), finishing the request if
        one of them stops it."""
        self._append(req, tokens, logprobs, time.monotonic())

    # ---- the step ----
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        self._step_preemptions = 0
        self._preempt_for_priority()  # deliberate: the seat goes to the waiting request now
        num_priority_preemptions = self._step_preemptions
        # Decodes first, then prefill chunks, each in policy order: a long prompt never
        # stalls the running decodes behind it. A gang (a group's beams) goes at its best place.
        seen: set[str] = set()
        for req in sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1,
                                                       self.key(r))):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING or req.request_id in seen or self.is_paused(req):
                continue  # preempted to make room for an earlier one, scheduled with its gang, or paused
            gang = gang_of(req)
            seen.update(m.request_id for m in gang)
            budget -= self._schedule_running(gang, budget, scheduled)
        if self._step_preemptions == num_priority_preemptions:  # admitting while short of blocks would thrash
            self._admit(scheduled, budget)
        finished, self._finished_ids = self._finished_ids, []
        loads, self._loads = self._loads, []
        return SchedulerOutput(scheduled, self.kv.take_copies(), finished, self._step_preemptions, loads)

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled ones (taking back rejected proposals), fork
        at fork points, finish what stopped. Returns the requests that gained a token or
        finished (new samples included)."""
        touched: list[Request] = []
        now = time.monotonic()
        for seq in out.scheduled:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue  # aborted while the step ran
            req.num_computed_tokens += len(seq.input_token_ids)
            self.kv.remove_skipped_blocks(req)  # what the window has passed goes back now
            if req.sampling_params.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:  # scored
                self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
                touched.append(req)
            if not seq.num_samples:
                continue
            tokens = result.sampled_token_ids[seq.request_id]
            if seq.spec_token_ids:  # the accepted proposals' K/V stays; the rest is taken back
                req.num_computed_tokens += len(tokens) - 1
                self.kv.trim(req, req.num_computed_tokens)
                self.kv.remove_skipped_blocks(req)
                req.num_spec_steps += 1
                req.num_spec_proposed += len(seq.spec_token_ids)
                req.num_spec_accepted += len(tokens) - 1
            forked = result.forked_token_ids.get(seq.request_id, [])
            children = self.fork(req, len(forked)) if forked else []
            touched += self._append(req, tokens, result.logprobs.get(seq.request_id), now)
            forked_logprobs = result.forked_logprobs.get(seq.request_id)
            for i, (child, token) in enumerate(zip(children, forked)):
                touched += self._append(child, [token], forked_logprobs and [forked_logprobs[i]], now)
        return list(dict.fromkeys(touched))

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
            num_used_slots=sum(self.kv.num_used_slots(r.request_id, r.num_computed_tokens) for r in self.running))

    def check_integrity(self) -> None:
        """Between steps: the pool's invariants, every request in exactly one queue that matches
        its status, one token always left to compute, and running tables that cover exactly the
        computed tokens (no block held past them)."""
        self.kv.check_integrity()
        assert len(self.running) + len(self.waiting) == len(self.requests)
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(r.status != RequestStatus.RUNNING and not r.is_finished for r in self.waiting)
        for req in self.requests.values():
            assert req.num_computed_tokens < req.num_tokens, req.request_id
            if req.status == RequestStatus.RUNNING:  # its tables cover exactly its computed tokens
                for g in self.kv.groups:  # and a sliding-window group holds only its window
                    assert len(g.table(req.request_id)) == num_blocks_for(req.num_computed_tokens, self.kv.block_size)
                    held = sum(1 for _ in g.held_blocks(req.request_id))
                    assert held <= g.max_blocks_held(req.num_computed_tokens + 1), (req.request_id, held)
            elif req.status != RequestStatus.SWAPPED:
                assert self.kv.num_held_blocks(req.request_id) == 0, req.request_id
            assert req.group_id in self.groups
        assert self.paused <= set(self.groups), "a paused group that is not unfinished"

    # ---- helpers ----
    def _register(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self._order[req.request_id] = next(self._counter)

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        num_new = min(req.num_tokens - num_computed, budget)
        if self.config.max_prefill_chunk is not None:
            num_new = min(num_new, self.config.max_prefill_chunk)
        return max(num_new, 1) if budget > 0 else 0

    def _num_spec_tokens(self, req: Request, budget: int) -> int:
        """How many of its proposals a decoding request verifies this step: within the budget,
        the context, and the output it may still produce (one more token always follows)."""
        if (not req.spec_token_ids or req.num_tokens - req.num_computed_tokens != 1 or self._is_fork_point(req)
                or req.sampling_params.use_beam_search):
            return 0
        room = min(budget, self.max_model_len - req.num_tokens,
                   req.sampling_params.max_tokens - req.num_output_tokens - 1)
        return max(min(len(req.spec_token_ids), room), 0)

    def _schedule_running(self, gang: list[Request], budget: int, scheduled: list[ScheduledSequence]) -> int:
        """Schedule a running gang's next tokens (a lone request's, or every beam of a group,
        which share the budget); returns the tokens it takes. A gang runs whole or not at all:
        one with a member out of the batch goes back to wait for it."""
        if any(m.status != RequestStatus.RUNNING for m in gang):
            self._preempt(gang[0])
            return 0
        share = budget // len(gang)
        sizes = [self._num_new_tokens(m, m.num_computed_tokens, share) for m in gang]
        specs = [self._num_spec_tokens(m, share - n) for m, n in zip(gang, sizes)]
        if not all(sizes):
            return 0  # no budget left for every beam: they wait together
        sizes = self._allocate_or_preempt(gang, sizes, specs, scheduled)
        for m, num_new, num_spec in zip(gang, sizes, specs):
            scheduled.append(self._scheduled(m, num_new, num_spec))
        return sum(sizes) + sum(specs) if sizes else 0

    def _allocate_or_preempt(self, gang: list[Request], sizes: list[int], specs: list[int],
                             scheduled: list[ScheduledSequence]) -> list[int]:
        """Allocate for the gang, preempting the worst running gangs not yet scheduled this step
        until it fits; returns the new tokens each member computes ([]: the gang had to go)."""
        taken: Optional[set[str]] = None  # made once a victim is needed: O(batch) per gang otherwise
        while not (allocated := self._allocate(gang, sizes, specs)):
            if taken is None:
                taken = {s.request_id for s in scheduled}
            # a paused request computes nothing meanwhile: it gives its blocks up first
            victim = max((r for r in self.running if r.request_id not in taken), key=self._victim_rank)
            if victim in gang and len(self.running) == len(gang):
                why = "this sequence" if len(gang) == 1 else f"the {len(gang)} beams of this request"
                for member in gang:
                    self._fail(member, f"the KV cache is too small to hold {why} alone")
                return []
            self._preempt(victim)
            if victim in gang:
                return []
        return allocated

    def _allocate(self, gang: list[Request], sizes: list[int], specs: list[int]) -> list[int]:
        """Blocks for every member's tokens, or none ([]); a lone prefill chunk may shrink to
        what fits where that holds fewer blocks (a window), proposals to verify never do."""
        if len(gang) == 1 and not specs[0]:
            fitted = self.kv.allocate_fitting(gang[0], sizes[0])
            return [fitted] if fitted else []
        need = sum(self.kv.blocks_to_allocate(m, n + k) for m, n, k in zip(gang, sizes, specs))
        if not self.kv.pool.can_take(need):
            return []
        for m, n, k in zip(gang, sizes, specs):
            allocated = self.kv.allocate_slots(m, n + k)
            assert allocated, m.request_id
        return sizes

    def _admit(self, scheduled: list[ScheduledSequence], budget: int) -> None:
        """Waiting requests in policy order, while seats, budget and blocks allow; a gang is
        admitted whole, and only when its group's worst case fits the free pool. A paused
        request gives its seat and blocks to a waiting one that lacks them (it computes nothing
        meanwhile: holding them would only stall the queue)."""
        while budget > 0 and (req := self.next_waiting()) is not None:
            gang = [m for m in gang_of(req) if m.status != RequestStatus.RUNNING]
            if len(self.running) + len(gang) > self.config.max_num_seqs:
                if self._preempt_a_paused():
                    continue
                break
            admit = self._admit_gang if runs_as_gang(req) else self._admit_one
            taken = admit(gang, budget, scheduled)
            if taken is None:
                if self._preempt_a_paused():
                    continue
                break
            budget -= taken

    def _preempt_a_paused(self) -> bool:
        """Preempt the policy's worst paused running request (with its gang); False: none runs."""
        paused = [r for r in self.running if self.is_paused(r)]
        if not paused:
            return False
        self._preempt(max(paused, key=self.key))
        return True

    def _admit_gang(self, gang: list[Request], budget: int,
                    scheduled: list[ScheduledSequence]) -> Optional[int]:
        """Every waiting beam of a group, each with an equal share of the budget, or none (None)."""
        share = budget // len(gang)
        need = max(self.worst_case_blocks(gang[0]), sum(self._admission_need(m, share) for m in gang))
        if not share or not self.kv.pool.can_take(need):
            return None
        taken = [self._admit_one([m], share, scheduled) for m in gang]
        assert None not in taken, "a gang's blocks were counted before it was admitted"
        return sum(t or 0 for t in taken)

    def _admission_need(self, req: Request, budget: int) -> int:
        """Pool blocks admitting req with this budget takes (changes nothing but its hashes)."""
        if req.status == RequestStatus.SWAPPED:
            return self.kv.blocks_to_swap_in(req, self._num_new_tokens(req, req.num_computed_tokens, budget))
        cached_blocks, num_cached = self._cached_prefix(req)
        return self.kv.blocks_to_allocate(req, self._num_new_tokens(req, num_cached, budget), cached_blocks)

    def worst_case_blocks(self, req: Request) -> int:
        """The most blocks req's group holds at once: every sequence it may run grown to its
        longest (a decode step each, as a window would hold them)."""
        params = req.sampling_params
        longest = min(req.num_prompt_tokens + params.max_tokens, self.max_model_len)
        return self.kv.group_blocks_needed(req.num_prompt_tokens, longest, group_width(params), 1)

    def _admit_one(self, gang: list[Request], budget: int,
                   scheduled: list[ScheduledSequence]) -> Optional[int]:
        """Admit a lone waiting request with its first tokens; returns how many (None: the pool is
        short, nothing changed)."""
        (req,) = gang
        if req.status == RequestStatus.SWAPPED:
            num_new = self._num_new_tokens(req, req.num_computed_tokens, budget)
            if not self.kv.swap_in(req, num_new):
                return None
        elif req.num_external_tokens:
            admitted = self._admit_external(req, budget)
            if admitted is None:
                return None
            num_new = admitted
        else:
            cached_blocks, num_cached = self._cached_prefix(req)
            num_new = self._num_new_tokens(req, num_cached, budget)
            num_new = self.kv.allocate_fitting(req, num_new, cached_blocks)
            if not num_new:
                return None
            self._record_admission(req, num_cached)
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        scheduled.append(self._scheduled(req, num_new, 0))
        return num_new

    def next_waiting(self) -> Optional[Request]:
        """The first waiting request in policy order that is not paused."""
        return next((r for r in self.waiting if r.group_id not in self.paused), None)

    def _cached_prefix(self, req: Request) -> tuple[list[list[int]], int]:
        # a request scoring its prompt computes every prompt token: cached blocks have no logits
        return self.kv.find_cached_prefix(req, use_cache=req.sampling_params.prompt_logprobs is None)

    def _admit_external(self, req: Request, budget: int) -> Optional[int]:
        """Blocks for the K/V another engine computed and for this step's tokens after it; the
        load is listed in the step's output. None when the pool is short."""
        num_external = req.num_external_tokens
        num_new = self._num_new_tokens(req, num_external, budget)
        if not self.kv.allocate_slots(req, num_external + num_new):
            return None
        self._record_admission(req, 0)
        req.num_computed_tokens, req.num_external_tokens = num_external, 0
        blocks = self.kv.block_table(req.request_id)[:num_blocks_for(num_external, self.kv.block_size)]
        self._loads.append((req.request_id, blocks))
        return num_new

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
        while (best := self.next_waiting()) is not None and self.running:
            worst = max(self.running, key=self.key)
            if self.key(best) >= self.key(worst):
                return
            first_chunk = min(best.num_tokens, self.config.max_num_batched_tokens)
            needs_blocks = not self.kv.pool.can_take(self.kv.blocks_needed(first_chunk))
            if len(self.running) < self.config.max_num_seqs and not needs_blocks:
                return
            self._preempt(worst)

    def _victim_rank(self, req: Request) -> tuple[bool, int, float, PolicyKey]:
        """The largest goes first: a paused request (it computes nothing meanwhile), then the
        policy's least important, then the cheapest to bring back, then the policy's last."""
        return (self.is_paused(req), self.key(req)[0], -self.preemption.restore_cost(self._victim(req)),
                self.key(req))

    def _victim(self, req: Request) -> Victim:
        num_blocks = self.kv.num_held_blocks(req.request_id)
        return Victim(req.num_computed_tokens, num_blocks, self.kv.can_swap_out(req), runs_as_gang(req))

    def _preempt(self, victim: Request) -> None:
        """Take the victim's gang (itself, or every running beam of its group) out of the
        running batch and queue it to resume, swapped or recomputed as the preemption mode
        chooses. Beams are computed again, never swapped: swapped one by one, the blocks they
        share would come back as a copy each."""
        swap, reason = self.preemption.choose(self._victim(victim))
        self.preemption_choices["swap" if swap else "recompute", reason] += 1
        for member in gang_of(victim):
            if member.status == RequestStatus.RUNNING:
                self._preempt_one(member, swap)

    def _preempt_one(self, victim: Request, swap: bool) -> None:
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._step_preemptions += 1
        victim.spec_token_ids, victim.spec_probs = [], None
        if swap and self.kv.swap_out(victim):
            victim.status = RequestStatus.SWAPPED
        else:  # recompute: blocks go back with their hashes, so re-prefill can hit them
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, victim, key=self.key)

    def _fail(self, req: Request, message: str) -> None:
        req.error = message
        self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
        self._failed.append(req)

    def take_failed(self) -> list[Request]:
        """The requests the scheduler ended with an error since the last call (req.error says why)."""
        failed, self._failed = self._failed, []
        return failed

    def _scheduled(self, req: Request, num_new: int, num_spec: int) -> ScheduledSequence:
        start = req.num_computed_tokens
        done = start + num_new == req.num_tokens
        params = req.sampling_params
        num_samples = num_logit_rows = 0
        if done and params.max_tokens > 0:
            if params.use_beam_search:  # beams are chosen over the whole group from their logits
                num_logit_rows = 1
            else:
                num_samples = params.n if self._is_fork_point(req) else 1
        spec, req.spec_token_ids = req.spec_token_ids[:num_spec], []
        spec_probs = None if req.spec_probs is None or not num_spec else req.spec_probs[:num_spec]
        req.spec_probs = None
        if params.prompt_logprobs is not None and start < req.num_prompt_tokens:
            num_logit_rows = num_new
        return ScheduledSequence(
            req.request_id, req.all_token_ids[start:start + num_new], start,
            self.kv.take_table_updates(req.request_id), params, num_samples,
            req.prompt_token_ids, req.output_token_ids,
            None if params.seed is None else params.seed + req.sample_index, spec, spec_probs,
            num_logit_rows=num_logit_rows)

    @staticmethod
    def _is_fork_point(req: Request) -> bool:
        """The step that samples the first output of an n > 1 request draws all n at once."""
        assert req.group is not None
        return (req.sampling_params.n > 1 and not req.sampling_params.use_beam_search
                and len(req.group.members) == 1 and req.num_output_tokens == 0)

    def _append(self, req: Request, tokens: list[int], logprobs: Optional[list[dict[int, float]]],
                now: float) -> list[Request]:
        """Append tokens in order until one finishes the request."""
        for i, token in enumerate(tokens):
            req.append_token(token, None if logprobs is None else logprobs[i])
            if req.first_token_time is None:
                req.first_token_time = now
            status = req.check_stop(self.max_model_len)
            if status is not None:
                self.finish_request(req.request_id, status)
                break
        return [req]
