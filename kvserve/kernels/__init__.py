"""Compiled CPU kernels (csrc/*.cpp), each built on first use with torch.utils.cpp_extension
and cached by torch between processes (the first build takes about a minute).

Where one cannot be built (no compiler, no ninja, a read-only cache) the caller runs its torch
path instead; the reason is logged once and kept in `failure(name)`.
  paged_attention  decode attention reading K/V blocks in place through the block table
  linear_bf16      bf16 x @ W^T for a few rows of x at memory bandwidth (AVX512-BF16)
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

logger = logging.getLogger("kvserve")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-fopenmp"]
_modules: dict[str, Any] = {}
_failures: dict[str, str] = {}


def load(name: str) -> Optional[Any]:
    """The compiled module csrc/<name>.cpp, or None (with the reason in `failure(name)`)."""
    if name in _modules or name in _failures:
        return _modules.get(name)
    try:
        from torch.utils.cpp_extension import load as build
        src = os.path.join(os.path.dirname(__file__), "csrc", f"{name}.cpp")
        _modules[name] = build(name=f"kvserve_{name}", sources=[src], extra_cflags=FLAGS,
                               extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a sandbox without /tmp ...
        _failures[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        logger.warning("CPU kernel %s unavailable (%s); using the torch path", name, _failures[name])
    return _modules.get(name)


def failure(name: str) -> Optional[str]:
    return _failures.get(name)
