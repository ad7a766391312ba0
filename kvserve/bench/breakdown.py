"""Where a step's time goes: each part's own (exclusive) wall time, timed around the methods that
do it, and what is left of the step (Python, elementwise ops, PyTorch's per-op cost) as "other".

    with StepBreakdown(engine.model) as b:
        for _ in range(64):
            engine.step()
    b.per_step_ms(64)  # {"matmul": 8.1, "attention": 2.9, ..., "other": 5.0}

Given the model, the methods its fast path bound in its modules' place (kvserve.modules) are
timed too, in the part of the method they stand for.

A timed call nested in another counts for itself only (the head's product inside sampling is
matmul, not sampling). The timers cost about a microsecond a call, a few hundred calls a step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Optional


def _parts() -> dict[str, list[tuple[type, str]]]:
    from kvserve.attention.layer import Attention
    from kvserve.core.scheduler import Scheduler
    from kvserve.engine.output_processor import OutputProcessor
    from kvserve.models.linear import Linear
    from kvserve.models.llama import RMSNorm, RotaryEmbedding
    from kvserve.models.packed import FusedPart, PackedLinear, PackedLinearQ8
    from kvserve.runner.model_runner import ModelRunner
    return {
        "matmul": [(Linear, "forward"), (PackedLinear, "forward"), (PackedLinearQ8, "forward"), (FusedPart, "forward")],
        "attention": [(Attention, "forward")],  # the cache write and the attention over it
        "norms": [(RMSNorm, "forward"), (RMSNorm, "add_forward")],
        "rope": [(RotaryEmbedding, "__call__"), (RotaryEmbedding, "rotate_qkv")],
        "sampling": [(ModelRunner, "_sample")],
        "prepare": [(ModelRunner, "prepare_step"), (ModelRunner, "context")],
        "schedule": [(Scheduler, "schedule"), (Scheduler, "update")],
        "outputs": [(OutputProcessor, "process")],
    }


class StepBreakdown:
    STEP = "step"

    def __init__(self, model: Optional[Any] = None) -> None:
        self.model = model
        self.totals: dict[str, float] = defaultdict(float)
        self._children: list[float] = []
        self._restore: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "StepBreakdown":
        from kvserve.engine.llm_engine import LLMEngine
        parts = _parts()
        for name, methods in parts.items():
            for cls, attr in methods:
                self._wrap(cls, attr, name)
        self._wrap(LLMEngine, "step", self.STEP)
        for module in self.model.modules() if self.model is not None else ():
            for attr in getattr(module, "fast_bound", ()):
                name = next((n for n, methods in parts.items()
                             if any(isinstance(module, cls) and attr == a for cls, a in methods)), None)
                if name is not None:
                    self._wrap(module, attr, name)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, original in reversed(self._restore):
            type.__setattr__(owner, attr, original) if isinstance(owner, type) else \
                object.__setattr__(owner, attr, original)
        self._restore.clear()

    def _wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time owner's `attr` (a class's method, or a function in a module instance's dict)."""
        original: Callable[..., Any] = owner.__dict__[attr]

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            self._children.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                inner = self._children.pop()
                elapsed = time.perf_counter() - t0
                self.totals[name] += elapsed if name == self.STEP else elapsed - inner
                if self._children:
                    self._children[-1] += elapsed

        type.__setattr__(owner, attr, timed) if isinstance(owner, type) else object.__setattr__(owner, attr, timed)
        self._restore.append((owner, attr, original))

    def per_step_ms(self, num_steps: int) -> dict[str, float]:
        """Each part's milliseconds a step, "other" the rest of the step, "step" the whole."""
        parts = {k: 1e3 * v / num_steps for k, v in self.totals.items() if k != self.STEP}
        step = 1e3 * self.totals[self.STEP] / num_steps
        return {**parts, "other": step - sum(parts.values()), self.STEP: step}
