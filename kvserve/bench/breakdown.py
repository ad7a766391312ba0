"""Where a step's time goes: each part's own (exclusive) wall time, timed around the methods that
do it, and what is left of the step (Python, elementwise ops, PyTorch's per-op cost) as "other".

    with StepBreakdown(engine) as b:
        for _ in range(64):
            engine.step()
    b.per_step_ms(64)  # {"matmul": 8.1, "attention": 2.9, ..., "other": 5.0}

Given the engine, the methods its model's fast path bound in its modules' place (kvserve.modules)
are timed too, in the part of the method they stand for, and so are the compiled kernels: the
fast path calls some of them from its blocks directly (a product's kernel from the attention
block), so the kernels' functions are wrapped and the fast path bound again to take the wrapped
ones (and again on exit, to take the originals). It is bound without decoder layers run as one
compiled call (`ModelRunner.use_fast_path(fused=False)`), whose kernels call each other unseen:
the steps timed call the blocks one by one, a little slower than the engine's own. The wrapped
kernels are the process's: another engine bound while the breakdown is open keeps them until it
is bound again.

A timed call nested in another counts for itself only (the head's product inside sampling is
matmul, not sampling). The timers cost about a microsecond a call, a few hundred calls a step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from types import ModuleType
from typing import Any, Callable, Iterator, Optional


def _parts() -> dict[str, list[tuple[type, str]]]:
    from kvserve.attention.layer import Attention
    from kvserve.core.scheduler import Scheduler
    from kvserve.engine.output_processor import OutputProcessor
    from kvserve.models.linear import Linear
    from kvserve.models.llama import RMSNorm, RotaryEmbedding
    from kvserve.models.packed import FusedPart, PackedLinear, PackedLinearQ8, PackedLinearQ8Rows
    from kvserve.models.products import DenseAbove
    from kvserve.runner.model_runner import ModelRunner
    return {
        "matmul": [(Linear, "forward"), (PackedLinear, "forward"), (PackedLinearQ8, "forward"),
                   (PackedLinearQ8Rows, "forward"), (DenseAbove, "forward"), (FusedPart, "forward")],
        "attention": [(Attention, "forward")],  # the cache write and the attention over it
        "norms": [(RMSNorm, "forward"), (RMSNorm, "add_forward")],
        "rope": [(RotaryEmbedding, "__call__"), (RotaryEmbedding, "rotate_qkv")],
        "sampling": [(ModelRunner, "_sample")],
        "prepare": [(ModelRunner, "prepare_step"), (ModelRunner, "context")],
        "schedule": [(Scheduler, "schedule"), (Scheduler, "update")],
        "outputs": [(OutputProcessor, "process")],
    }


# the compiled kernels' functions timed, by part (kvserve.kernels; the others are left in "other")
KERNEL_PARTS = {
    "matmul": ("linear_q8", "linear_quant", "linear_bf16", "linear_bf16_tiles"),
    "attention": ("paged_decode", "paged_decode_int8", "paged_decode_fp8", "paged_decode_int4", "store_kv",
                  "store_kv_int8", "mla_decode", "mla_decode_int8", "mla_decode_fp8", "chunk_attention"),
    "norms": ("rms_norm", "add_rms_norm"),
    "rope": ("rope_qkv", "rotate_halves"),
}


def kernel_functions() -> Iterator[tuple[ModuleType, str]]:
    """(module, name) of each function of each compiled kernel loaded here (its one build this
    CPU runs; `isa` left out): what a timer wraps to see the kernels the fast path calls."""
    from kvserve import kernels
    from kvserve.kernels.levels import KERNEL_ISAS
    seen: set[int] = set()
    for name in KERNEL_ISAS:
        module = kernels.load(name)
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        for attr in dir(module):
            if not attr.startswith("_") and attr != "isa" and callable(getattr(module, attr)):
                yield module, attr


class StepBreakdown:
    STEP = "step"

    def __init__(self, engine: Optional[Any] = None) -> None:
        self.engine = engine
        self.model = engine.model if engine is not None else None
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)  # timed calls by part (a bound product and its kernel: 2)
        self._children: list[float] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self._fused = True  # whether the engine ran decoder layers as one call before (restored on exit)

    def __enter__(self) -> "StepBreakdown":
        try:
            self._wrap_all()
        except BaseException:
            self.__exit__()  # nothing left wrapped
            raise
        return self

    def _wrap_all(self) -> None:
        from kvserve.engine.llm_engine import LLMEngine
        parts = _parts()
        for name, methods in parts.items():
            for cls, attr in methods:
                self._wrap(cls, attr, name)
        self._wrap(LLMEngine, "step", self.STEP)
        if self.engine is not None and self.engine.runner.fast_path:
            self._fused = self.engine.runner.fused_layers
            self._wrap_kernels()
            self.engine.runner.use_fast_path(True, fused=False)  # the blocks take the wrapped kernels
        for module in self.model.modules() if self.model is not None else ():
            for attr in getattr(module, "fast_bound", ()):
                name = next((n for n, methods in parts.items()
                             if any(isinstance(module, cls) and attr == a for cls, a in methods)), None)
                if name is not None:
                    self._wrap(module, attr, name)

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, original in reversed(self._restore):
            type.__setattr__(owner, attr, original) if isinstance(owner, type) else \
                object.__setattr__(owner, attr, original)
        self._restore.clear()
        if self.engine is not None and self.engine.runner.fast_path:
            self.engine.runner.use_fast_path(True, fused=self._fused)  # the original kernels again

    def _wrap_kernels(self) -> None:
        part_of = {fn: part for part, fns in KERNEL_PARTS.items() for fn in fns}
        for module, fn in kernel_functions():
            if fn in part_of:
                self._wrap(module, fn, part_of[fn])

    def _wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time owner's `attr` (a class's method, or a function in a module instance's dict)."""
        extension = isinstance(owner, ModuleType)
        original: Callable[..., Any] = getattr(owner, attr) if extension else owner.__dict__[attr]

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            self._children.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                inner = self._children.pop()
                elapsed = time.perf_counter() - t0
                self.totals[name] += elapsed if name == self.STEP else elapsed - inner
                self.calls[name] += 1
                if self._children:
                    self._children[-1] += elapsed

        if isinstance(owner, type):
            type.__setattr__(owner, attr, timed)
        else:
            object.__setattr__(owner, attr, timed)  # a module instance's dict, or an extension module's
        self._restore.append((owner, attr, original))

    def per_step_ms(self, num_steps: int) -> dict[str, float]:
        """Each part's milliseconds a step, "other" the rest of the step, "step" the whole."""
        parts = {k: 1e3 * v / num_steps for k, v in self.totals.items() if k != self.STEP}
        step = 1e3 * self.totals[self.STEP] / num_steps
        return {**parts, "other": step - sum(parts.values()), self.STEP: step}
