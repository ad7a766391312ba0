"""Whatever a test's engine started here (tensor-parallel ranks, a prefill process) is stopped when
the test ends, even when the test failed before closing its engine."""

from __future__ import annotations

import multiprocessing
import warnings
from typing import Iterator

import pytest

from tests.processes import stop_children


@pytest.fixture(autouse=True)
def no_process_left() -> Iterator[None]:
    before = set(multiprocessing.active_children())
    yield
    left = [p for p in multiprocessing.active_children() if p not in before]
    if left:  # a closed engine has joined its workers: these were left by a failure
        warnings.warn(f"stopping processes the test left running: {[p.name for p in left]}", RuntimeWarning)
        stop_children(left)
    _leave_process_group()


def _leave_process_group() -> None:
    """Rank 0 of an engine that was never closed still holds torch.distributed's default group,
    and the next engine could not create its own."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
