"""Modules called straight through to `forward`.

A decode step calls about ten modules per layer, 300 for SmolLM2. `nn.Module.__call__` spends
about 2.5 us on each before `forward` runs (hook dictionaries, tracing state), 0.75 ms a step
next to a step of about 10 ms. kvserve registers no hooks on its models, so the layers it calls
every step (norms, projections, attention and MLP blocks, decoder layers) skip that machinery.
A hook registered on one of them would not run: register it on the model instead.
"""

from __future__ import annotations

from typing import Any


class DirectCall:
    """Mix in before nn.Module: calling the module calls its forward, and nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)  # type: ignore[attr-defined]
