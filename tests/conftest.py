"""Shared fixtures: the two real models (loaded once per session) and small factories."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
STORIES_DIR = REPO.parent / "shared" / "models" / "stories260K"
STORIES_GOLDEN = ("Once upon a time, there was a little girl named Lily. "
                  "She loved to play outside in the park.")


@pytest.fixture(scope="session")
def stories_path() -> str:
    if not (STORIES_DIR / "stories260K.bin").exists():
        pytest.fail(f"stories260K is missing at {STORIES_DIR} (see its SOURCE.md)")
    return str(STORIES_DIR)


@pytest.fixture(scope="session")
def stories(stories_path: str):
    from kvserve.models.registry import load_weights
    return load_weights(stories_path)


def random_llama(num_layers: int = 4, vocab: int = 128, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                 max_len: int = 256, seed: int = 0) -> Any:
    """A Llama with random weights (scaled so greedy paths are not degenerate), no tokenizer."""
    import torch
    from kvserve.config import ModelConfig
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.models.loaders.base import LoadedModel
    config = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_len, name=f"random-llama-{seed}")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    sd = {k: (torch.ones(shape) if k.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.2)
          for k, shape in shapes.items()}
    return LoadedModel(config, sd, None, config.name)


@pytest.fixture(scope="session")
def tiny_llama():
    return random_llama()


@pytest.fixture
def q8_copies(monkeypatch: Any) -> None:
    """The defaults keep the AMX policy's dense path for Q4_0 / Q4_1 / Q8_0 (above 64 rows) on any
    CPU with bf16 instructions, so that path is shown where the CPU's own policy keeps none
    (AVX512-BF16 without AMX: kvserve.models.products.default_policy)."""
    import dataclasses
    from kvserve.config import BF16_CPU_FLAGS
    from kvserve.models import products
    monkeypatch.setattr(products, "DEFAULT_POLICIES",
                        (dataclasses.replace(products.AMX_POLICY, dense_needs=BF16_CPU_FLAGS),))


@pytest.fixture(scope="session")
def smollm2():
    from kvserve.models.registry import load_weights
    return load_weights("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from kvserve.models.registry import default_model_path
    return default_model_path()


def compiled_kernel(name: str, isa: Optional[str] = None) -> Any:
    """The built module of a kernel at an instruction-set level; skips (with the reason) where
    compiled kernels are turned off or there is no C++ compiler to build them at install, fails
    where the install should have built it."""
    import shutil
    from kvserve import kernels
    from kvserve.config import env_cxx, env_kernel_mode
    if env_kernel_mode() == "off":
        pytest.skip("compiled kernels are turned off (KVSERVE_KERNELS=off)")
    module = kernels.load(name, isa)
    if module is None and shutil.which(env_cxx()) is None:
        pytest.skip(f"no C++ compiler, so the install built no kernels: {kernels.failure(name)}")
    if module is None:
        pytest.fail(f"kernel {name} is not usable: {kernels.failure(name)}")
    return module


def kernel_isas(name: str) -> list[str]:
    """Every level of a kernel this CPU runs (the portable one always): each is tested."""
    from kvserve import kernels
    return kernels.supported_isas(name)


def make_engine(loaded: Any, **options: Any):
    """An engine over already-loaded weights; options as LLM(...) takes them."""
    from kvserve.engine.llm_engine import LLMEngine
    options.setdefault("num_blocks", 256)
    return LLMEngine.from_options("preloaded", loaded=loaded, **options)


def scaled_rows(n: int, k: int, seed: int = 0) -> Any:
    """A random fp32 weight [n, k] whose rows have different scales (the kernels' test matrices)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch (and the kernels' at::parallel_for) on n threads inside the block, as before after it."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_llm(loaded: Any, **options: Any):
    from kvserve.engine.llm import LLM
    options.setdefault("num_blocks", 256)
    return LLM("preloaded", loaded=loaded, **options)


def greedy(max_tokens: int = 16, **kw: Any):
    from kvserve.core.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run_collecting_logits(engine: Any, prompts: list, params: Any) -> tuple[list, dict]:
    """Run prompts to completion; returns outputs in order and each request's logits per step."""
    import torch
    logits: dict[str, list[torch.Tensor]] = {}

    def hook(ids: list[str], rows: torch.Tensor) -> None:
        for rid, row in zip(ids, rows):
            logits.setdefault(rid, []).append(row.clone())

    stop = engine.runner.on_logits.add(hook)
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    stop()
    return [done[i] for i in ids], {i: logits[i] for i in ids}


def assert_same_outputs(a: tuple, b: tuple) -> None:
    """Two runs of the same prompts, each run_collecting_logits' (outputs, logits by request id)
    followed by anything else (fresh_and_gathered's read counts, left out): the same tokens, and
    every request's logits at every step equal bit for bit."""
    import torch
    (outs, logits), (other_outs, other_logits) = a[:2], b[:2]
    assert len(logits) == len(other_logits) == len(outs)
    for out, other in zip(outs, other_outs, strict=True):
        assert out.outputs[0].token_ids == other.outputs[0].token_ids
        rows, other_rows = logits[out.request_id], other_logits[other.request_id]
        assert len(rows) == len(other_rows) and all(torch.equal(x, y) for x, y in zip(rows, other_rows))


def fresh_and_gathered(monkeypatch: Any, storage_cls: type, make: Any, prompts: list, params: Any) -> dict:
    """Run the prompts on make()'s engine twice: as it is (fresh: a chunk that starts its sequence
    attends to its own K/V, cast as the cache gives them back) and with storage_cls naming no such
    dtype (gathered: every chunk reads its K/V back from the cache). {True: fresh, False:
    gathered}, each (outputs, logits, the cached positions each chunk_context call read before
    its chunk)."""
    runs = {}
    chunk_context = storage_cls.chunk_context
    for fresh in (True, False):
        reads: list[int] = []

        def counting(self: Any, *args: Any, reads: list = reads, **kwargs: Any) -> Any:
            reads.append(args[2])
            return chunk_context(self, *args, **kwargs)
        with monkeypatch.context() as patch:
            patch.setattr(storage_cls, "chunk_context", counting)
            if not fresh:
                patch.setattr(storage_cls, "reads_back_as", lambda self: None)
            runs[fresh] = (*run_collecting_logits(make(), prompts, params), reads)
    return runs


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
