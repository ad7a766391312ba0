"""The engine's LoRA adapters: loaded at start (--lora-modules) or at run time, named by
requests, and unloaded only when no request still runs them.

A request's LoRARequest is resolved here to the loaded adapter it names, and given that load's id
(`lora_int_id`): the id goes into the request's block hashes (Request.cache_keys), so K/V computed
through one adapter is never shared with the base model, another adapter, or an adapter loaded
later under the same name.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

from kvserve.config import LoRAConfig
from kvserve.core.request import Request
from kvserve.core.sampling_params import LoRARequest, SamplingParams
from kvserve.models.lora import LoRAAdapter, LoRAError, LoRASet


class EngineLoRA:
    def __init__(self, adapters: LoRASet, config: LoRAConfig) -> None:
        self.adapters = adapters
        for name, path in config.modules:
            adapters.load(name, path)

    @property
    def names(self) -> list[str]:
        return list(self.adapters.adapters)

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.adapters.get(name)
        if adapter is None:
            raise LoRAError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters.adapters)}")
        return adapter

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """params with its LoRARequest naming the loaded adapter (and that load's id); a path not
        yet loaded is loaded under the name. LoRAError where the request does not match."""
        want = params.lora_request
        assert want is not None
        if want.lora_name not in self.adapters.adapters and want.lora_path:
            self.adapters.load(want.lora_name, want.lora_path)
        adapter = self.get(want.lora_name)
        if want.lora_path and os.path.abspath(want.lora_path) != adapter.path:
            raise LoRAError(f"LoRA adapter {adapter.name!r} is loaded from {adapter.path}, not {want.lora_path}")
        if want.lora_int_id and want.lora_int_id != adapter.lora_id:
            raise LoRAError(f"LoRA adapter {adapter.name!r} has id {adapter.lora_id}, not {want.lora_int_id}")
        return dataclasses.replace(params, lora_request=LoRARequest(adapter.name, adapter.lora_id, adapter.path))

    def load(self, name: str, path: str) -> LoRAAdapter:
        return self.adapters.load(name, path)

    def unload(self, name: str, requests: Iterable[Request]) -> LoRAAdapter:
        """Unload the adapter; refused (LoRAError) while unfinished requests run it."""
        self.get(name)
        users = [r.request_id for r in requests if not r.is_finished and r.sampling_params.lora_request is not None
                 and r.sampling_params.lora_request.lora_name == name]
        if users:
            raise LoRAError(f"LoRA adapter {name!r} is in use by {len(users)} unfinished request(s) "
                            f"({', '.join(users[:3])}): unload it once they finish")
        return self.adapters.unload(name)
