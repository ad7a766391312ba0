"""AsyncEngine: one engine loop feeding every connection, on its own thread or on the caller's.

The engine is touched by that thread only. The event loop hands it commands (add, abort) through
a queue and gets back futures and per-request output queues, so an HTTP handler never waits for a
model step and a model step never waits for HTTP.

`kvserve serve` runs the loop on the main thread, the one that loaded the model, and HTTP on
another (`run_here`): torch's OpenMP keeps one pool of worker threads per thread that starts a
parallel region, and once two pools exist on 2 cores (more workers than CPUs) every worker sleeps
between regions instead of spinning. Each of the ~300 kernel calls of a decode step then waits on
a futex wake-up (~60 us): a step run from a second thread took 17 ms instead of 5.5
(benchmarks/serving_peers.py --only overhead).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from kvserve.engine.llm_engine import EngineStats, LLMEngine, Prompt
from kvserve.engine.outputs import RequestOutput, coalesce
from kvserve.core.sampling_params import SamplingParams


PAUSE_AFTER_S = 1.0  # a stream whose reader has taken nothing for this long is paused
MAX_UNREAD_S = 30.0  # and for this long, aborted
STOPPED_READING = "the client stopped reading its stream"


class _Mailbox:
    """What a request's reader has not taken yet, folded into one output (engine.outputs.coalesce):
    a reader that falls behind gets everything since its last read at once, and the memory held for
    it stays that of one output however far behind it is. Used on the event loop only."""

    def __init__(self) -> None:
        self.pending: Optional[RequestOutput] = None
        self.unread_since: Optional[float] = None
        self.paused = False  # its request is held out of the steps until the reader catches up
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self.pending = out if self.pending is None else coalesce(self.pending, out)
        self.unread_since = self.unread_since or time.monotonic()
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        out, self.pending, self.unread_since = self.pending, None, None
        self._ready.clear()
        assert out is not None
        return out


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int
    cache_salt: Optional[str]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future  # set to None, or to the exception add_request raised
    outputs: _Mailbox


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_finished: Optional[Callable[[RequestOutput], None]] = None,
                 max_unread_s: float = MAX_UNREAD_S, pause_after_s: float = PAUSE_AFTER_S,
                 own_thread: bool = True) -> None:
        """own_thread False: start() starts nothing and the caller runs the loop (run_here)."""
        self.engine = engine
        self.own_thread = own_thread
        self.max_unread_s = max_unread_s
        self.pause_after_s = pause_after_s
        self.on_finished = on_finished  # metrics hook, called on the engine thread
        self._commands: "queue.Queue[Any]" = queue.Queue()
        self._streams: dict[str, _Add] = {}
        self._stop = threading.Event()
        self.stats: EngineStats = engine.stats()
        self.num_steps_failed = 0
        self._loop_done = threading.Event()  # the loop has returned (set until it first runs)
        self._loop_done.set()

    def start(self) -> None:
        """Run the loop on a thread of its own (own_thread), else nothing: run_here() runs it."""
        if self.own_thread:
            self._loop_done.clear()
            threading.Thread(target=self._run_loop, name="kvserve-engine", daemon=True).start()

    def run_here(self, until: Callable[[], bool] = lambda: False) -> None:
        """Run the loop on the calling thread until stop() or until() is true (checked between
        steps and at least every 0.1 s). For an AsyncEngine made with own_thread False."""
        if self.own_thread:
            raise RuntimeError("this AsyncEngine runs its loop on its own thread (own_thread=True)")
        self._loop_done.clear()
        self._run_loop(until)

    def stop(self, timeout: float = 5.0) -> None:
        """End the loop and wait (at most timeout) for its last step to end."""
        self._stop.set()
        self._commands.put(None)
        self._loop_done.wait(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       priority: int = 0, cache_salt: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come. Leaving early (a client that disconnects)
        aborts the request, which frees its blocks at once. A reader that falls pause_after_s
        behind has its request paused (nothing computed for it) until it reads again; one that
        reads nothing for max_unread_s has it aborted."""
        loop = asyncio.get_running_loop()
        cmd = _Add(request_id, prompt, params, priority, cache_salt, loop, loop.create_future(), _Mailbox())
        self._commands.put(cmd)
        error = await cmd.done
        if error is not None:
            raise error
        finished = False
        try:
            while not finished:
                out = await cmd.outputs.get()
                finished = out.finished
                if cmd.outputs.paused:  # the reader caught up
                    cmd.outputs.paused = False
                    self._commands.put(("resume", request_id))
                yield out
        finally:
            if not finished:
                self._commands.put(("abort", request_id, None))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) run on the engine thread between two steps (what it reads is one instant's);
        the figures /metrics reports are taken at that instant too."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("call", fn, loop, done))
        ok, value = await done
        if not ok:
            raise value
        return value

    def abort(self, request_id: str, reason: Optional[str] = None) -> None:
        """End a request. With a reason, whoever still awaits its outputs gets a last one with
        that error (a handler waiting for a first output that will now never come)."""
        self._commands.put(("abort", request_id, reason))

    def end_all(self, message: str) -> None:
        """End every request in flight with this error (a server that shuts down): each stream
        gets a last output with the error instead of being cut."""
        self._commands.put(("end_all", message))

    # ---- the engine thread ----
    def _run_loop(self, until: Callable[[], bool] = lambda: False) -> None:
        try:
            self._run(until)
        finally:
            self._loop_done.set()

    def _run(self, until: Callable[[], bool]) -> None:
        while not self._stop.is_set() and not until():
            # a paused request waits for its reader, not for a step: the thread waits for commands
            self._drain_commands(block=not self.engine.has_runnable())
            if not self.engine.has_runnable():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step must not kill every stream silently
                self.num_steps_failed += 1
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                continue
            self.stats = self.engine.stats()
            self._deliver(outputs)

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority,
                                        time.monotonic(), cmd.cache_salt)
                self._streams[cmd.request_id] = cmd
                cmd.loop.call_soon_threadsafe(_set_result, cmd.done, None)
            except Exception as e:
                cmd.loop.call_soon_threadsafe(_set_result, cmd.done, e)
        elif cmd[0] == "call":
            _, fn, loop, done = cmd
            try:
                result = (True, fn(self.engine))
                self.stats = self.engine.stats()
            except Exception as e:
                result = (False, e)
            loop.call_soon_threadsafe(_set_result, done, result)
        elif cmd[0] == "end_all":
            self._fail_all(cmd[1])
        elif cmd[0] == "pause":
            self.engine.pause(cmd[1])
        elif cmd[0] == "resume":
            self.engine.resume(cmd[1])
        elif cmd[0] == "abort":
            _, rid, reason = cmd
            if self.engine.abort(rid):
                self.stats = self.engine.stats()
            stream = self._streams.pop(rid, None)
            if stream is not None and reason is not None:
                stream.loop.call_soon_threadsafe(stream.outputs.put, _error_output(rid, reason))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their event loops, one wake-up a loop a step: each
        call_soon_threadsafe writes the loop's wake-up pipe, which with a batch of streams was
        a system call and a loop iteration per request per token."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Add, RequestOutput]]] = {}
        for out in outputs:
            cmd = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                if self.on_finished is not None:
                    self.on_finished(out)
            if cmd is not None:
                by_loop.setdefault(cmd.loop, []).append((cmd, out))
        for loop, offers in by_loop.items():
            loop.call_soon_threadsafe(self._offer_all, offers)

    def _offer_all(self, offers: list[tuple[_Add, RequestOutput]]) -> None:
        for cmd, out in offers:
            self._offer(cmd, out)

    def _offer(self, cmd: _Add, out: RequestOutput) -> None:
        """On the event loop: hand `out` to the request's reader. One that has taken nothing for
        pause_after_s has its request paused (and aborted if it still reads nothing by
        max_unread_s); one that has taken nothing for max_unread_s has it aborted."""
        box = cmd.outputs
        unread_s = 0.0 if box.unread_since is None else time.monotonic() - box.unread_since
        if unread_s > self.max_unread_s and not out.finished:
            self.abort(cmd.request_id, STOPPED_READING)
        elif unread_s > self.pause_after_s and not out.finished and not box.paused:
            box.paused = True
            self._commands.put(("pause", cmd.request_id))
            cmd.loop.call_later(self.max_unread_s - unread_s + 0.01, self._abort_if_unread, cmd)
        box.put(out)

    def _abort_if_unread(self, cmd: _Add) -> None:
        """On the event loop, max_unread_s after a stream's reader last read, if it was paused
        then: abort it when it has still read nothing (a paused request makes no output that
        would check)."""
        box = cmd.outputs
        if box.paused and box.unread_since is not None \
                and time.monotonic() - box.unread_since >= self.max_unread_s:
            self.abort(cmd.request_id, STOPPED_READING)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._streams):
            self.engine.abort(rid)
            cmd = self._streams.pop(rid)
            cmd.loop.call_soon_threadsafe(cmd.outputs.put, _error_output(rid, message))
        self.stats = self.engine.stats()


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _error_output(request_id: str, message: str) -> RequestOutput:
    from kvserve.engine.outputs import RequestMetrics
    return RequestOutput(request_id, None, [], [], True, RequestMetrics(time.monotonic()), error=message)
