"""kvserve: an LLM inference and serving engine built around its KV cache."""

from kvserve.core.sampling_params import SamplingParams

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
