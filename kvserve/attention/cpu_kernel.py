"""The compiled CPU decode kernel (csrc/paged_attention.cpp), built on first use with
torch.utils.cpp_extension and cached by torch between processes. Where it cannot be built (no
compiler, no ninja) the torch reference path runs instead, and the reason is logged once."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("kvserve")
_module: Any = None
_failure: Optional[str] = None
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-fopenmp"]


def load() -> Optional[Any]:
    """The compiled module, or None (with the reason in `failure()`)."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    try:
        from torch.utils.cpp_extension import load as build
        src = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention.cpp")
        _module = build(name="kvserve_paged_attention", sources=[src], extra_cflags=FLAGS,
                        extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a sandbox without /tmp ...
        _failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch path", _failure)
    return _module


def failure() -> Optional[str]:
    return _failure


def decode_fn() -> Optional[Callable[..., torch.Tensor]]:
    module = load()
    return None if module is None else module.paged_decode
