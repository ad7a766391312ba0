"""The compiled CPU decode kernel (kvserve/kernels/csrc/paged_attention.cpp): one query token
per sequence attends to its context read in place through the block table."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from kvserve import kernels


def decode_fn(isa: Optional[str] = None) -> Optional[Callable[..., torch.Tensor]]:
    """The kernel at level `isa` (default: the best this CPU runs), or None where it cannot be
    built or compiled kernels are turned off."""
    module = kernels.load("paged_attention", isa)
    return None if module is None else module.paged_decode


def failure() -> Optional[str]:
    return kernels.failure("paged_attention")
