"""The compiled CPU decode kernel (kvserve/kernels/csrc/paged_attention.cpp): one query token
per sequence attends to its context read in place through the block table."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from kvserve import kernels


def decode_fn() -> Optional[Callable[..., torch.Tensor]]:
    module = kernels.load("paged_attention")
    return None if module is None else module.paged_decode


def failure() -> Optional[str]:
    return kernels.failure("paged_attention")
