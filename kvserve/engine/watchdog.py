"""Watchdog: a request that keeps running without getting anywhere is ended with the reason, so
it cannot hold the engine, or its blocks, forever.

The scheduler admits a group only when it fits and preempts a group's beams together, so
nothing should stall; this guards against what slips past (a group whose blocks stopped being
shared, a bug). A request stalls in a step when it ran and its progress (computed tokens plus
output tokens) did not grow over the step, or when the step ran nothing at all while it heads
the waiting queue (or runs). After `max_stalled_steps` stalled steps in a row it is reported;
any progress resets the count. Waiting behind others is not stalling: a long queue is no fault.
"""

from __future__ import annotations

from kvserve.core.outputs import SchedulerOutput
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler

MAX_STALLED_STEPS = 64  # a group's beams gather again within a few steps; a wedge never does


def progress(req: Request) -> int:
    """What a step adds to when it gets the request anywhere (a beam whose row was taken back
    adds nothing; a recomputed prompt adds its chunk)."""
    return req.num_computed_tokens + req.num_output_tokens


class Watchdog:
    """Counts stalled steps by group (the beams of a group gathering again make progress as a
    group while the ones already there wait) and reports a group that stalled too long."""

    def __init__(self, max_stalled_steps: int = MAX_STALLED_STEPS) -> None:
        self.max_stalled_steps = max_stalled_steps
        self._stalled: dict[str, int] = {}  # group id -> stalled steps in a row
        # this step's groups: the members it runs, and their progress before it
        self._watched: dict[str, tuple[list[Request], int]] = {}

    def watch(self, out: SchedulerOutput, scheduler: Scheduler) -> None:
        """Before the step runs: the progress of what it runs, or, when it runs nothing, of
        what blocks the engine (the head of the waiting queue, and anything running)."""
        for rid in out.finished_request_ids:
            if rid not in scheduler.groups:
                self._stalled.pop(rid, None)
        members: dict[str, list[Request]] = {}
        blocking: list[Request] = []
        if out.is_empty:  # a paused request is held back on purpose: it blocks nothing
            head = scheduler.next_waiting()
            blocking = ([head] if head is not None else []) + [r for r in scheduler.running
                                                               if not scheduler.is_paused(r)]
        for req in [scheduler.requests[s.request_id] for s in out.scheduled] + blocking:
            members.setdefault(req.group_id, []).append(req)
        self._watched = {gid: (reqs, sum(map(progress, reqs))) for gid, reqs in members.items()}

    def stalled(self, scheduler: Scheduler) -> list[tuple[str, str]]:
        """After the step: a member of each group stalled max_stalled_steps steps in a row, with
        why."""
        ended = []
        for gid, (reqs, before) in self._watched.items():
            if gid not in scheduler.groups or sum(map(progress, reqs)) > before:
                self._stalled.pop(gid, None)
                continue
            count = self._stalled[gid] = self._stalled.get(gid, 0) + 1
            if count >= self.max_stalled_steps:
                del self._stalled[gid]
                live = next(m for m in scheduler.groups[gid].members if not m.is_finished)
                ended.append((live.request_id, self._why(live, scheduler, count)))
        return ended

    @staticmethod
    def _why(req: Request, scheduler: Scheduler, count: int) -> str:
        pool = scheduler.kv.pool
        state = "ran" if req.status == RequestStatus.RUNNING else "waited while nothing ran"
        return (f"no progress in {count} steps: the request {state} without computing a token it "
                f"kept (its group may hold {scheduler.worst_case_blocks(req)} blocks at once; the KV "
                f"cache has {pool.num_blocks}, {pool.num_free_blocks} free, {len(scheduler.running)} "
                f"requests running), so it was ended to let the others go on")
