"""Retention priorities: a request asks that the blocks covering token ranges of its prompt
outlive other cached blocks (a system prompt that should survive between chat turns).

    RetentionRange(start=0, end=512, priority=90, duration_s=60)

Token positions [start, end) of the prompt; priority 1-100 (higher is kept longer; blocks
nobody asked for have DEFAULT_RETENTION_PRIORITY); duration_s: seconds after the block is cached
or read that the priority holds, then it falls back to the default (None: as long as cached).
A block takes the highest priority among the ranges that overlap it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

DEFAULT_RETENTION_PRIORITY = 35  # as TensorRT-LLM's default: room to rank below and above it
MIN_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY = 1, 100


class RetentionError(ValueError):
    """A retention range that cannot be honoured; the message follows the field name kv_retention."""


@dataclass(frozen=True)
class RetentionRange:
    start: int
    end: int
    priority: int
    duration_s: Optional[float] = None

    def __post_init__(self) -> None:
        if not _is_int(self.start) or self.start < 0:
            raise RetentionError(f"start must be an integer >= 0, got {self.start!r}")
        if not _is_int(self.end) or self.end <= self.start:
            raise RetentionError(f"end must be an integer > start ({self.start}), got {self.end!r}")
        if not _is_int(self.priority) or not MIN_RETENTION_PRIORITY <= self.priority <= MAX_RETENTION_PRIORITY:
            raise RetentionError(f"priority must be an integer in [1, 100], got {self.priority!r}")
        d = self.duration_s
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < math.inf):
            raise RetentionError(f"duration_s must be a number of seconds > 0, got {d!r}")

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_FIELDS = ("start", "end", "priority", "duration_s")


def parse_retention(value: Any) -> tuple[RetentionRange, ...]:
    """A list of {"start", "end", "priority", "duration_s"?} objects (as a request body gives
    them) or RetentionRanges -> RetentionRanges; RetentionError names what is wrong."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise RetentionError(f"must be a list of ranges, got {type(value).__name__}")
    ranges = []
    for item in value:
        if isinstance(item, RetentionRange):
            ranges.append(item)
            continue
        if not isinstance(item, Mapping):
            raise RetentionError(f"each range must be an object, got {item!r}")
        unknown = set(item) - set(_FIELDS)
        missing = {"start", "end", "priority"} - set(item)
        if unknown or missing:
            raise RetentionError(f"range {dict(item)!r}: "
                                 + (f"unknown fields {sorted(unknown)}" if unknown else f"missing {sorted(missing)}"))
        ranges.append(RetentionRange(**item))
    return tuple(ranges)


def block_retention(ranges: Sequence[RetentionRange], start: int, end: int) -> Optional[RetentionRange]:
    """The range that rules the block of token positions [start, end): the highest priority among
    those overlapping it, the longest-lived among equals (None: no range covers it)."""
    best: Optional[RetentionRange] = None
    for r in ranges:
        if r.overlaps(start, end) and (best is None or _outranks(r, best)):
            best = r
    return best


def _outranks(a: RetentionRange, b: RetentionRange) -> bool:
    if a.priority != b.priority:
        return a.priority > b.priority
    return b.duration_s is not None and (a.duration_s is None or a.duration_s > b.duration_s)
