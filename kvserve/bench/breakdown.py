"""Where a step's time goes: each part's own (exclusive) wall time, timed around the methods that
do it, and what is left of the step (Python, elementwise ops, PyTorch's per-op cost) as "other".

    with StepBreakdown() as b:
        for _ in range(64):
            engine.step()
    b.per_step_ms(64)  # {"matmul": 8.1, "attention": 2.9, ..., "other": 5.0}

A timed call nested in another counts for itself only (the head's product inside sampling is
matmul, not sampling). The timers cost about a microsecond a call, a few hundred calls a step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable


def _parts() -> dict[str, list[tuple[type, str]]]:
    from kvserve.attention.layer import Attention
    from kvserve.core.scheduler import Scheduler
    from kvserve.engine.output_processor import OutputProcessor
    from kvserve.models.gemma import GemmaRMSNorm
    from kvserve.models.linear import Linear
    from kvserve.models.llama import RMSNorm, RotaryEmbedding
    from kvserve.models.packed import FusedPart, PackedLinear, PackedLinearQ8
    from kvserve.runner.decode_plan import DecodePlan
    from kvserve.runner.model_runner import ModelRunner
    return {
        "matmul": [(Linear, "forward"), (PackedLinear, "forward"), (PackedLinearQ8, "forward"), (FusedPart, "forward")],
        "attention": [(Attention, "forward")],  # the cache write and the attention over it
        # a decode step's layers run by the flat loop: attention, norms, RoPE and its own Python
        # (the products inside it count as matmul)
        "decode plan": [(DecodePlan, "__call__")],
        "norms": [(RMSNorm, "forward"), (RMSNorm, "add_forward"), (GemmaRMSNorm, "forward")],
        "rope": [(RotaryEmbedding, "__call__"), (RotaryEmbedding, "rotate_qkv")],
        "sampling": [(ModelRunner, "_sample")],
        "prepare": [(ModelRunner, "prepare_step"), (ModelRunner, "context")],
        "schedule": [(Scheduler, "schedule"), (Scheduler, "update")],
        "outputs": [(OutputProcessor, "process")],
    }


class StepBreakdown:
    STEP = "step"

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._children: list[float] = []
        self._restore: list[tuple[type, str, Any]] = []

    def __enter__(self) -> "StepBreakdown":
        from kvserve.engine.llm_engine import LLMEngine
        for name, methods in _parts().items():
            for cls, attr in methods:
                self._wrap(cls, attr, name)
        self._wrap(LLMEngine, "step", self.STEP)
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, attr, original in reversed(self._restore):
            setattr(cls, attr, original)
        self._restore.clear()

    def _wrap(self, cls: type, attr: str, name: str) -> None:
        original: Callable[..., Any] = cls.__dict__[attr]

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

        setattr(cls, attr, timed)
        self._restore.append((cls, attr, original))

    def per_step_ms(self, num_steps: int) -> dict[str, float]:
        """Each part's milliseconds a step, "other" the rest of the step, "step" the whole."""
        parts = {k: 1e3 * v / num_steps for k, v in self.totals.items() if k != self.STEP}
        step = 1e3 * self.totals[self.STEP] / num_steps
        return {**parts, "other": step - sum(parts.values()), self.STEP: step}
