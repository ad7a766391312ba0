"""LoRA adapters over HTTP, as vLLM serves them: a request names an adapter as its `model`,
/v1/models lists the adapters beside the base model, and adapters are loaded and unloaded while
the server runs:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Loading and unloading run on the engine thread between two steps. An unload is refused (400)
while unfinished requests run the adapter; it never waits for them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from kvserve.core.sampling_params import LoRARequest, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.errors import APIError


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None  # vLLM's clients may send it; it must name the loaded adapter


def adapter_names(engine: LLMEngine) -> list[str]:
    return [] if engine.lora is None else list(engine.lora.names)


def with_adapter(params: SamplingParams, name: Optional[str], engine: LLMEngine) -> SamplingParams:
    """params running the adapter `name` names, where it names one (else as they are)."""
    if name is None or name not in adapter_names(engine):
        return params
    return dataclasses.replace(params, lora_request=LoRARequest(name))


def adapter_cards(engine: LLMEngine, model_name: str) -> list[dict[str, Any]]:
    """The loaded adapters as /v1/models lists them (vLLM's fields: root, the adapter's path;
    parent, the base model)."""
    return [{"id": a.name, "object": "model", "created": 0, "owned_by": "kvserve", "root": a.path,
             "parent": model_name, "max_model_len": engine.max_model_len} for a in engine.lora_adapters()]


def install_lora_routes(app: FastAPI, aengine: AsyncEngine, engine: LLMEngine, model_name: str) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> PlainTextResponse:
        if body.lora_name == model_name:
            raise APIError(400, f"lora_name: {model_name!r} is the base model's name", "lora_name")
        try:
            await aengine.call(lambda e: e.load_lora(body.lora_name, body.lora_path))
        except ValueError as e:
            raise APIError(400, str(e), "lora_path" if "already loaded" not in str(e) else "lora_name") from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> PlainTextResponse:
        def unload(e: LLMEngine) -> None:
            if body.lora_int_id is not None and e.lora is not None and body.lora_name in e.lora.names \
                    and e.lora.get(body.lora_name).lora_id != body.lora_int_id:
                raise ValueError(f"LoRA adapter {body.lora_name!r} has id {e.lora.get(body.lora_name).lora_id}, "
                                 f"not {body.lora_int_id}")
            e.unload_lora(body.lora_name)
        try:
            await aengine.call(unload)
        except ValueError as e:
            status = 404 if "unknown LoRA adapter" in str(e) else 400
            raise APIError(status, str(e), "lora_name") from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
