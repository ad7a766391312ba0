"""Tensor parallelism as the engine sees it: a seam the floor above fills.

The engine is rank 0. Splitting it over N ranks takes four things that live in
kvserve/distributed/, a floor above the engine, so the engine cannot import them. It names them
here (`TensorParallel`). The package root (kvserve/__init__.py, the top of the floors) provides
kvserve.distributed's, and that module is imported only when an engine has more than one rank:

    LLMEngine --tensor_parallel(N)--> TensorParallel <--provide()-- kvserve/__init__.py
                                                         (kvserve.distributed.workers.TENSOR_PARALLEL)

This module imports nothing from kvserve or torch at run time: the package root imports it, and
importing kvserve.core must still load no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from torch import nn

    from kvserve.config import EngineConfig, ModelConfig
    from kvserve.kv.sizing import CachePlan
    from kvserve.models.loaders.base import LoadedModel
    from kvserve.runner.model_runner import CacheLayout, StepMirror

    class Ranks(StepMirror, Protocol):
        """Ranks 1..N-1 as rank 0 holds them: they hear every block move and forward pass
        before rank 0 runs it (the runner's StepMirror) until they are closed."""

        def close(self) -> None: ...


class CommStats:
    """Time and bytes of this rank's collectives (the waiting for slower ranks included); all
    zero for an engine of one rank."""

    def __init__(self) -> None:
        self.num_all_reduces = 0
        self.all_reduce_bytes = 0
        self.all_reduce_s = 0.0


@dataclass(frozen=True)
class TensorParallel:
    """What the engine asks of tensor parallelism over `world` ranks, rank 0 being itself."""

    # raise ValueError naming what of the model does not split over world ranks
    check_shardable: Callable[[ModelConfig, int], None]
    # rank's share of the weights (loaded, rank, world): a new LoadedModel, the original left whole
    shard_weights: Callable[[LoadedModel, int, int], LoadedModel]
    # after each row-parallel product, add up the ranks' partial sums (counted in the stats)
    install_row_parallel: Callable[[nn.Module, CommStats], None]
    # ranks 1..N-1 over the whole model, each cutting its own share, with rank 0's plan and layout
    start_ranks: Callable[[EngineConfig, LoadedModel, CachePlan, CacheLayout, Sequence[int]], Optional[Ranks]]


_provider: Optional[Callable[[], TensorParallel]] = None


def provide(provider: Callable[[], TensorParallel]) -> None:
    """Fill the seam: `provider` is called each time an engine of more than one rank is built."""
    global _provider
    _provider = provider


def tensor_parallel(world: int) -> Optional[TensorParallel]:
    """None for one rank (the engine alone); otherwise the tensor parallelism provided."""
    if world == 1:
        return None
    if _provider is None:
        raise ValueError(f"tensor_parallel_size {world}: no tensor parallelism is provided "
                         "(kvserve/__init__.py provides kvserve.distributed's)")
    return _provider()
