"""OpenAI request bodies (the subset kvserve serves), bounded so no body can ask for the absurd."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, model_validator

from kvserve.core.sampling_params import SamplingParams
from kvserve.config import FieldError
from kvserve.server.fields import check_extra

MAX_N = 16
MAX_STOP = 8
MAX_PROMPTS = 64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: the usage so far in every chunk
    include_obfuscation: Optional[StrictBool] = None  # ignored (kvserve/server/fields.py)


MAX_BIAS_ENTRIES = 300  # OpenAI's bound on logit_bias's size
MAX_RETENTION_RANGES = 64


class _Common(BaseModel):
    """The fields completions and chat share. Extra fields go through the field policy
    (kvserve/server/fields.py): ignored ones are listed by `ignored_fields()`, refused and unknown
    ones are a 400 naming them."""

    model_config = ConfigDict(extra="allow")
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _policy(self) -> "_Common":
        self._ignored = check_extra(dict(self.model_extra or {}))
        if self.stream_options is not None and self.stream_options.include_obfuscation is not None:
            self._ignored.append("stream_options.include_obfuscation")
        return self

    def ignored_fields(self) -> list[str]:
        return list(self._ignored)

    model: Optional[str] = Field(None, max_length=256)
    max_tokens: Optional[StrictInt] = Field(None, ge=1, le=1 << 20)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=100.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1, le=1 << 20)
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[StrictInt] = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0, le=10.0)
    cache_salt: Optional[str] = Field(None, max_length=256)
    priority: StrictInt = Field(0, ge=-1000, le=1000)
    ignore_eos: StrictBool = False
    # vLLM's extra parameters for beam search: n beams returned out of best_of (default n)
    use_beam_search: StrictBool = False
    best_of: Optional[StrictInt] = Field(None, ge=1, le=MAX_N)
    length_penalty: StrictFloat = Field(1.0, ge=-10.0, le=10.0)
    early_stopping: Union[StrictBool, Literal["never"]] = False

    # structured outputs: OpenAI's response_format, or vLLM's guided_* parameters (one of them)
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = Field(None, max_length=4096)
    guided_choice: Optional[list[str]] = Field(None, min_length=1, max_length=256)
    guided_grammar: Optional[str] = Field(None, max_length=65536)
    logit_bias: Optional[dict[str, Union[StrictInt, StrictFloat]]] = Field(None, max_length=MAX_BIAS_ENTRIES)
    # kvserve's extension (TensorRT-LLM's retention priorities): [{"start", "end", "priority" 1-100,
    # "duration_s"?}] token ranges of the prompt whose cached blocks outlive others (SamplingParams checks them)
    kv_retention: Optional[list[Any]] = Field(None, max_length=MAX_RETENTION_RANGES)

    def bias(self) -> dict[int, float]:
        """logit_bias's token id strings as ids (SamplingParams checks the bounds)."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise FieldError("logit_bias", f"keys must be token ids written as decimal strings, got {key!r}")
            out[int(key)] = float(value)
        return out

    def structured(self) -> Optional[tuple[str, str]]:
        """(kind, spec) for SamplingParams.structured, from whichever field asks for it."""
        asked: list[tuple[str, tuple[str, str]]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                asked.append(("response_format", ("json_schema", '{"type": "object"}')))
            elif kind == "json_schema":
                schema = (rf.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise FieldError("response_format", "json_schema needs {\"json_schema\": {\"schema\": {...}}}")
                asked.append(("response_format", ("json_schema", json.dumps(schema))))
            elif kind != "text":
                raise FieldError("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
        if self.guided_json is not None:
            spec = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            asked.append(("guided_json", ("json_schema", spec)))
        if self.guided_regex is not None:
            asked.append(("guided_regex", ("regex", self.guided_regex)))
        if self.guided_choice is not None:
            asked.append(("guided_choice", ("choice", json.dumps(self.guided_choice))))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", ("grammar", self.guided_grammar)))
        if len(asked) > 1:
            raise FieldError(asked[1][0], "only one of response_format and guided_* at a time")
        return asked[0][1] if asked else None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > 256 for s in stops):
            raise FieldError("stop", f"takes at most {MAX_STOP} non-empty strings of at most 256 characters", " ")
        return tuple(stops)

    def sampling_params(self, default_max_tokens: int, logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens, stop=self.stops(),
            prompt_logprobs=prompt_logprobs, structured=self.structured(),
            ignore_eos=self.ignore_eos, logprobs=logprobs, use_beam_search=self.use_beam_search,
            beam_width=(self.best_of or self.n) if self.use_beam_search else None,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping, logit_bias=self.bias(),
            kv_retention=tuple(self.kv_retention or ()))


class CompletionRequest(_Common):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]] = Field(
        ..., description="a string, a list of token ids, or a list of either (one choice set each)")
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    echo: StrictBool = False
    max_tokens: Optional[StrictInt] = Field(None, ge=0, le=1 << 20)  # 0 with echo: score the prompt only

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of the request: one, or the list's items."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)) or not p:
            return [p]  # type: ignore[list-item]
        if len(p) > MAX_PROMPTS:
            raise FieldError("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(p)}")
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(..., max_length=64)
    text: Optional[str] = None


class ChatMessage(BaseModel):
    """OpenAI's message: content a string or a list of parts (text only here); "developer" is
    the system role by its newer name; assistant messages may carry tool_calls, tool messages
    answer one (tool_call_id)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = Field(None, max_length=256)
    tool_calls: Optional[list[dict[str, Any]]] = Field(None, max_length=64)
    tool_call_id: Optional[str] = Field(None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise FieldError("messages", f"a content part of type {part.type!r}: this model takes text only")
        return "\n".join(part.text for part in self.content if part.text is not None)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it."""
        m: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                m[key] = getattr(self, key)
        return m


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=512)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1, le=1 << 20)
    # tool calling (kvserve/server/tools.py): functions the model may call, and whether it must
    tools: Optional[list[dict[str, Any]]] = Field(None, max_length=128)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the template."""

    model: Optional[str] = Field(None, max_length=256)
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, max_length=512)
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model: Optional[str] = Field(None, max_length=256)
    tokens: list[StrictInt] = Field(..., max_length=1 << 20)
