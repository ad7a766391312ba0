"""Host memory for activations: keep freed blocks in the process for reuse.

PyTorch has no caching allocator on CPU: every activation is a malloc. glibc serves large
requests with a fresh mmap and trims freed heap memory back to the OS, so each step faults its
activation pages in again, and page faults are expensive on virtual machines (measured here: a
fresh 10 MB tensor takes 17 ms to write, a reused one 0.7 ms). Raising glibc's mmap threshold
and trim threshold keeps freed activations in the heap, where the next step reuses them.

SmolLM2 fp32 on 2 cores, before -> after: a 32-request shared-prefix prefill step 3.2 -> 2.2 s,
a 1,024-token prefill 1.25 -> 1.07 s, a batch-32 decode step 125 -> 116 ms. The price is the
one every caching allocator pays: the process keeps its high-water mark of activation memory.
Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger("kvserve")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_BYTES = 64 << 20  # larger blocks (rare: a huge batch) still get their own mmap
TRIM_THRESHOLD_BYTES = 1 << 30
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply once per process; True where glibc took the settings."""
    global _applied
    if _applied is None:
        try:
            libc = ctypes.CDLL("libc.so.6")
            _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
        except (OSError, AttributeError):  # not glibc
            _applied = False
        logger.debug("glibc keeps freed activation memory: %s", _applied)
    return _applied
