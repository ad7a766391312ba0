"""LLM: offline generation over many prompts, results in input order."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterator, Optional, Sequence, Union

from kvserve.config import DEFAULT_MODEL
from kvserve.engine.llm_engine import LLMEngine, Prompt
from kvserve.engine.outputs import RequestOutput
from kvserve.models.loaders.base import LoadedModel
from kvserve.core.sampling_params import LoRARequest, SamplingParams

LoRAArg = Union[LoRARequest, str, None]


class LLM:
    """`LLM(model=..., **engine_options).generate(prompts, SamplingParams(...))`; the options are
    those of the command line, by their flat names (kvserve.engine.args.ENGINE_OPTIONS)."""

    def __init__(self, model: str = DEFAULT_MODEL, loaded: Optional[LoadedModel] = None,
                 **options: Any) -> None:
        self.engine = LLMEngine.from_options(model, loaded, **options)

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False, priority: Optional[Sequence[int]] = None,
                 lora_request: Union[LoRAArg, Sequence[LoRAArg]] = None) -> list[RequestOutput]:
        """lora_request: the LoRA adapter (a LoRARequest or a loaded adapter's name) every prompt
        runs with, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        plist = _with_adapters(plist, lora_request)
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                ids.append(self.engine.add_request(None, prompt, p, priority[i] if priority else 0))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[dict[str, str]], params: Optional[SamplingParams] = None) -> RequestOutput:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer to apply a chat template with")
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (deltas included)."""
        rid = self.engine.add_request(None, prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while len(done) < len(ids) and self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def _with_adapters(plist: list[SamplingParams], lora: Union[LoRAArg, Sequence[LoRAArg]]) -> list[SamplingParams]:
    """Each prompt's params with its adapter; one given both ways must be the same adapter."""
    if lora is None:
        return plist
    adapters = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(plist)
    if len(adapters) != len(plist):
        raise ValueError(f"{len(plist)} prompts but {len(adapters)} lora requests")
    out = []
    for p, a in zip(plist, adapters):
        a = LoRARequest(a) if isinstance(a, str) else a
        if p.lora_request is not None and a is not None and p.lora_request.lora_name != a.lora_name:
            raise ValueError(f"lora_request {a.lora_name!r} differs from the sampling params' "
                             f"{p.lora_request.lora_name!r}")
        out.append(p if a is None else dataclasses.replace(p, lora_request=a))
    return out


def _progress(total: int):  # type: ignore[no-untyped-def]
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc="generate", unit="req", file=sys.stderr)
    except ImportError:
        return None
