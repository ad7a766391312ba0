"""Module machinery shared by the model and attention floors: modules called straight through to
`forward`, and the fast path a runner binds into them.

DirectCall. A decode step calls about ten modules per layer, 300 for SmolLM2, and
`nn.Module.__call__` spends about 2.5 us on each before `forward` runs (hook dictionaries,
tracing state): 0.75 ms a step next to a step of about 10 ms. kvserve registers no hooks on its
models, so the layers it calls every step skip that machinery. A hook registered on one of them
would not run: register it on the model instead.

FastPath. A module's `forward` is its eager definition: it checks, call by call, which kernel
its inputs can take (device, dtype, layout) and falls back to torch. Once a model is loaded on
its device and its attention backend installed, those answers are the same at every step, so a
module can say once what it would call (`fast_methods`), and `bind_fast_path` puts those
functions in the module's place: the same kernels on the same arguments in the same order, so
hidden states equal the eager modules' bit for bit, without the checks. The runner decides
whether a model runs bound (fast) or eager; a model file only says, per building block, what
its fast form is. A new architecture assembled from the building blocks is fast with no code of
its own, and a subclass that redefines a method without redefining `fast_methods` keeps its
eager method (its fast form would not be its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn


class DirectCall:
    """Mix in before nn.Module: calling the module calls its forward, and nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class FastPathEnv:
    """What a module needs to know to choose its kernels once: where the model runs, its
    activations' dtype, the compiled layer kernels (kvserve.kernels' layer_ops, None where they
    are not built or turned off) and the KV storage the attention layers write (None: no cache)."""

    device: torch.device
    dtype: torch.dtype
    layer_ops: Optional[Any] = None
    storage: Optional[Any] = None
    # whether a block may run its children's kernels as one compiled call (layer_ops' DecodeLayer)
    # instead of calling them one by one; a tool that times the kernels one by one binds without
    fused: bool = True
    # whether a model whose layers all run as one call may run them all in one (layer_ops'
    # DecodeStack) instead of one call a layer; a tool that compares the two binds without
    stacked: bool = True

    @property
    def cpu_ops(self) -> Optional[Any]:
        """The layer kernels where they apply (a CPU model), else None."""
        return self.layer_ops if self.device.type == "cpu" else None


class KernelCall(NamedTuple):
    """A module's forward as one compiled call for the rows a fast path gives it: for fp32
    x [M, K] with M <= rows, forward(x) is fn(x, *operands); for more rows, the module's forward
    (`module`). A block that holds the module calls fn itself: one Python frame fewer (about
    half a microsecond) a call, where a decode step at batch 1 makes a few hundred."""

    fn: Callable[..., Any]
    operands: tuple[Any, ...]
    rows: float
    module: Any


def kernel_call(module: Any, env: "FastPathEnv") -> KernelCall:
    """The module's KernelCall where env's activations are fp32 and it has one (a method
    `kernel_call(env)` that does not return None, defined where its forward is or below: a
    subclass that redefines forward alone keeps it), else its forward as the call (bound first:
    children bind before parents)."""
    call_definer = _definer(type(module), "kernel_call")
    own_call = call_definer is not None and issubclass(call_definer, _definer(type(module), "forward"))
    own = getattr(module, "kernel_call", None) if env.dtype == torch.float32 and own_call else None
    call = own(env) if own is not None else None
    return call if call is not None else KernelCall(module.forward, (), math.inf, module)


def rows_op(module: Any, env: "FastPathEnv") -> Optional[Any]:
    """The module's KernelCall for env as one compiled operation that another kernel calls without
    Python (a kvserve.RowsOp capsule: kernels/csrc/kernel_ops.h; the same kernel on the same
    operands), or None: the module has no kernel call for env, or no such operation (a method
    `rows_op(call)` defined in the class that defines its kernel_call)."""
    if not has_rows_op(module):
        return None
    call = kernel_call(module, env)
    return module.rows_op(call) if call.module is module and call.fn != module.forward else None


def has_rows_op(module: Any) -> bool:
    """Whether the module's class defines rows_op(call) where it defines kernel_call (a subclass
    that redefines kernel_call alone makes calls its parent's rows_op does not know)."""
    definer = _definer(type(module), "kernel_call")
    return definer is not None and _definer(type(module), "rows_op") is definer


class FastPath:
    """Mix in to a module that has a fast form. `fast_methods(env)` returns the functions to use
    in place of some of its methods (by name) for this env, or {} where the eager ones must run.
    Binding happens children first, so a module's fast form may call its children's bound ones."""

    def fast_methods(self, env: FastPathEnv) -> dict[str, Callable[..., Any]]:
        return {}

    def bind(self, env: FastPathEnv) -> list[str]:
        """Put this module's fast methods in place for env; returns the names bound."""
        self.unbind()
        methods = self.fast_methods(env)
        own: type = _definer(type(self), "fast_methods")
        bound = [name for name in methods if _definer(type(self), name) is not None
                 and issubclass(own, _definer(type(self), name))]
        for name in bound:  # in the instance's dict, in front of the class's method
            object.__setattr__(self, name, methods[name])
        object.__setattr__(self, "_fast_bound", tuple(bound))
        return bound

    def unbind(self) -> None:
        """Back to the eager methods."""
        for name in self.__dict__.pop("_fast_bound", ()):
            self.__dict__.pop(name, None)

    @property
    def fast_bound(self) -> tuple[str, ...]:
        return tuple(self.__dict__.get("_fast_bound", ()))


def runs_fast_form_of(module: Any, cls: type, methods: tuple[str, ...]) -> bool:
    """Whether the module runs cls's own fast form of these methods: each bound, and fast_methods
    not redefined below cls (a method is bound only where it is defined at the fast form's class
    or above it, so each means what cls's does). A parent that calls such a module's kernels in
    place of these methods asks this first."""
    bound = getattr(module, "fast_bound", ())
    return all(m in bound for m in methods) and _definer(type(module), "fast_methods") is cls


def _definer(cls: type, name: str) -> Any:
    """The class in cls's MRO whose own body defines `name` (None: none does)."""
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def bind_fast_path(model: nn.Module, env: FastPathEnv) -> dict[str, list[str]]:
    """Bind every FastPath module of the model, children before their parents, and pin every
    module's submodules (below); returns the bound method names by module name (modules that
    bound nothing left out). Bind once the model's structure is final: unbind before changing it."""
    named = list(model.named_modules())
    bound = {}
    for name, module in reversed(named):  # pre-order reversed: every child before its parent
        _pin_children(module)
        if isinstance(module, FastPath):
            methods = module.bind(env)
            if methods:
                bound[name] = methods
    return bound


def unbind_fast_path(model: nn.Module) -> None:
    """Every module of the model back to its eager methods, its submodules unpinned."""
    for module in model.modules():
        if isinstance(module, FastPath):
            module.unbind()
        for name in module.__dict__.pop("_pinned", ()):
            module.__dict__.pop(name, None)


def _pin_children(module: nn.Module) -> None:
    """A submodule is found by nn.Module.__getattr__, a Python function run after the ordinary
    lookup fails (about 0.7 us; a decoder layer makes four such lookups a step). Pinned, each is
    also in the module's instance dict, where the ordinary lookup finds it. Assigning a module
    to the name later replaces the pin too (nn.Module.__setattr__ clears the dict's entry)."""
    pinned = tuple(name for name, child in module._modules.items() if child is not None)
    for name in pinned:
        object.__setattr__(module, name, module._modules[name])
    object.__setattr__(module, "_pinned", pinned)
