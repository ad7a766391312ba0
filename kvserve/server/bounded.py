"""Work that must not take the threads every request needs: a few threads of its own and a
bounded queue, past which a call is refused at once (`Busy`) instead of waiting.

The server tokenizes completions' prompts on one set of these threads (with no bound on the
queue, as asyncio's default executor has none); /tokenize and /detokenize, which anyone may call
where no API key is set, run on another, so that a flood of them (1 MiB of text is seconds of
tokenizing) waits for those threads alone. The threads are daemons: work still running at exit (a
call cannot be interrupted) does not hold the process past its shutdown grace, as asyncio's
default executor's threads would (asyncio.run joins them).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, TypeVar

T = TypeVar("T")


class Busy(RuntimeError):
    """Every thread is working and the queue is full."""


class BoundedThreads:
    def __init__(self, name: str, num_threads: int, max_waiting: Optional[int]) -> None:
        """name: what the calls serve, as a refusal names it ("/tokenize and /detokenize");
        max_waiting None: calls queue without a bound."""
        if num_threads < 1 or (max_waiting is not None and max_waiting < 0):
            raise ValueError(f"{name}: needs num_threads >= 1 and max_waiting >= 0")
        self.name, self.num_threads, self.max_waiting = name, num_threads, max_waiting
        self._jobs: "queue.SimpleQueue[Optional[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]]" = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.num_pending = 0  # running or queued; a call whose caller left still counts until it ends

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on one of the threads; Busy if num_threads + max_waiting calls are pending."""
        with self._lock:
            if self.max_waiting is not None and self.num_pending >= self.num_threads + self.max_waiting:
                raise Busy(f"{self.name}: {self.num_threads} thread(s) working and {self.max_waiting} call(s) "
                           "queued; retry shortly")
            self.num_pending += 1
            self._start_threads()
        job: Future[T] = Future()
        job.add_done_callback(self._ended)
        self._jobs.put((job, fn, args))
        return await asyncio.wrap_future(job)  # a cancelled caller cancels the job if it has not begun

    def close(self) -> None:
        """Stop the threads once the calls queued before have ended (without waiting for them)."""
        with self._lock:
            for _ in self._threads:
                self._jobs.put(None)
            self._threads = []

    def _start_threads(self) -> None:  # on first use: an app that never needs them starts none
        while len(self._threads) < self.num_threads:
            t = threading.Thread(target=self._work, name=f"kvserve-bounded-{len(self._threads)}", daemon=True)
            t.start()
            self._threads.append(t)

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, fn, args = item
            if not job.set_running_or_notify_cancel():
                continue
            try:
                job.set_result(fn(*args))
            except BaseException as e:  # the caller gets it
                job.set_exception(e)

    def _ended(self, _: Future[Any]) -> None:
        with self._lock:
            self.num_pending -= 1
