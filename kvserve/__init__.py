"""kvserve: an LLM inference and serving engine built around its KV cache."""

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine import parallel as _parallel

__version__ = "0.1.0"
__all__ = ["SamplingParams", "LLM", "LLMEngine", "__version__"]


def __getattr__(name: str):  # torch is imported only when the engine is asked for
    if name == "LLM":
        from kvserve.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from kvserve.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


def _tensor_parallel() -> "_parallel.TensorParallel":
    """kvserve.distributed's tensor parallelism. The engine cannot import the floor above it, so
    the package root, the top of the floors, plugs it into the engine's seam; it is imported only
    when an engine of more than one rank is built."""
    from kvserve.distributed.workers import TENSOR_PARALLEL
    return TENSOR_PARALLEL


_parallel.provide(_tensor_parallel)
