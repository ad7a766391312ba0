"""Observers: several parties' callbacks for one event, where a lower floor tells a higher one
(or a test) that something happened without knowing who listens.

    released = Observers[[Request], None]()
    stop = released.add(capture)   # a prefill engine reads a request's K/V before it goes
    released(req)                  # each callback, in the order they were added
    stop()                         # capture no longer called
"""

from __future__ import annotations

from typing import Any, Callable, Generic, ParamSpec

P = ParamSpec("P")


class Observers(Generic[P]):
    def __init__(self) -> None:
        self._callbacks: list[Callable[P, Any]] = []

    def add(self, callback: Callable[P, Any]) -> Callable[[], None]:
        """Call `callback` at each event from now on; returns the function that stops it."""
        self._callbacks.append(callback)
        return lambda: self.remove(callback)

    def remove(self, callback: Callable[P, Any]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for callback in list(self._callbacks):
            callback(*args, **kwargs)

    def __bool__(self) -> bool:
        """Whether anyone listens (so a caller can skip building what it would pass)."""
        return bool(self._callbacks)

    def __len__(self) -> int:
        return len(self._callbacks)
