"""The Responses API: POST /v1/responses and GET /v1/responses/{id}, as OpenAI and vLLM serve it.

A request is turned into a chat completion and run through the chat path (templates, tools and
their parsers, structured outputs, the field policy), so the two endpoints cannot drift apart:

    input items                      chat messages
    "text" or {"role", "content"} -> {"role", "content"}          (input_text / output_text parts)
    {"type": "function_call"}     -> an assistant message's tool_calls
    {"type": "function_call_output"} -> {"role": "tool", "tool_call_id", "content"}
    instructions                  -> a system message first (not carried to later responses)
    previous_response_id          -> the stored conversation before the input

The chat reply comes back as output items (a message with output_text, and one function_call
item per call), whole or as Responses' typed stream events, each with its sequence_number.
Responses with `store` (the default) are kept in memory, the oldest dropped past
MAX_STORED_RESPONSES.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, model_validator

from kvserve.config import FieldError
from kvserve.server.errors import APIError
from kvserve.server.fields import REFUSED, check_extra
from kvserve.server.protocol import ChatCompletionRequest

MAX_STORED_RESPONSES = 1024
MAX_INPUT_ITEMS = 512
# the chat request's field -> the Responses field it came from (errors name what the client sent)
FROM_CHAT = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens"}
RESPONSES_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    **REFUSED,
    "truncation": (("disabled",), "an input longer than the context is a 400, never cut"),
    "background": ((), "a response runs while its request is open"),
    "include": (((),), "no extra output data (logprobs, encrypted reasoning) is served here"),
    "conversation": ((), "conversations continue through previous_response_id"),
    "prompt": ((), "stored prompt templates are not served"),
    "max_tool_calls": ((), "the number of calls is not capped here"),
    "top_logprobs": ((0,), "logprobs are served by /v1/chat/completions"),
    "context_management": ((), "the input is never compacted here"),
}
TEXT_PARTS = ("input_text", "output_text", "text")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: Optional[StrictBool] = None  # ignored (kvserve/server/fields.py)


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses (the subset kvserve serves; the rest goes through the field
    policy: ignored fields reported, refused and unknown ones a 400 naming them)."""

    model_config = ConfigDict(extra="allow")
    _ignored: list[str] = PrivateAttr(default_factory=list)

    model: Optional[str] = Field(None, max_length=256)
    input: Union[str, list[dict[str, Any]]] = Field(..., max_length=MAX_INPUT_ITEMS)
    instructions: Optional[str] = None
    max_output_tokens: Optional[StrictInt] = Field(None, ge=1, le=1 << 20)
    temperature: Optional[Union[StrictInt, StrictFloat]] = Field(None, ge=0.0, le=100.0)
    top_p: Optional[Union[StrictInt, StrictFloat]] = Field(None, gt=0.0, le=1.0)
    tools: Optional[list[dict[str, Any]]] = Field(None, max_length=128)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[dict[str, Any]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    store: StrictBool = True
    previous_response_id: Optional[str] = Field(None, max_length=256)
    metadata: Optional[dict[str, str]] = Field(None, max_length=16)

    @model_validator(mode="after")
    def _policy(self) -> "ResponsesRequest":
        self._ignored = check_extra(dict(self.model_extra or {}), RESPONSES_REFUSED)
        if self.stream_options is not None and self.stream_options.include_obfuscation is not None:
            self._ignored.append("stream_options.include_obfuscation")
        if self.text is not None and "verbosity" in self.text:
            self._ignored.append("text.verbosity")
        return self

    def ignored_fields(self) -> list[str]:
        return list(self._ignored)


class ResponseStore:
    """Stored responses by id, each with its conversation as chat messages (input and output,
    without the instructions); the oldest is dropped past max_responses."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be >= 1, got {max_responses}")
        self.max_responses = max_responses
        self.items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self.items[response["id"]] = (response, conversation)
        while len(self.items) > self.max_responses:
            self.items.popitem(last=False)

    def get(self, response_id: str, field: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The stored response and conversation; 404 naming the id (and the field it came in)."""
        if response_id not in self.items:
            raise APIError(404, f"{field}: no stored response with id '{response_id}' (responses are kept with "
                           f"store: true, the latest {self.max_responses})", field, "NotFoundError",
                           "response_not_found")
        return self.items[response_id]


def input_messages(items: Union[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The input as chat messages (see the module's table)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(i, item))
        elif kind == "function_call":
            call = {"id": _str(i, item, "call_id"), "type": "function",
                    "function": {"name": _str(i, item, "name"), "arguments": _str(i, item, "arguments")}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _str(i, item, "call_id"),
                        "content": _text(i, item.get("output"))})
        else:
            raise FieldError("input", f"item {i}: type {kind!r} is not served (message, function_call, "
                             "function_call_output)")
    return out


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise FieldError("input", f"item {i}: role must be user, system, developer or assistant, got {role!r}")
    return {"role": role, "content": _text(i, item.get("content"))}


def _text(i: int, content: Any) -> str:
    """A message's (or a call output's) text: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError("input", f"item {i}: content must be a string or a list of parts")
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise FieldError("input", f"item {i}: a content part of type {kind!r}: this model takes text only")
    return "".join(part["text"] for part in content)


def _str(i: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise FieldError("input", f"item {i}: {key} must be a string")
    return value


def chat_tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """Responses' flat function tools as chat's {"type": "function", "function": {...}}."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise FieldError("tools", f"item {i}: only function tools are served, got type {t.get('type')!r}")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Optional[Union[str, dict[str, Any]]]) -> Optional[Union[str, dict[str, Any]]]:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise FieldError("tool_choice", 'a named choice is {"type": "function", "name": ...}')
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """text.format as chat's response_format."""
    if text is None:
        return None
    if set(text) - {"format", "verbosity"}:
        raise FieldError("text", f"takes format (and verbosity), got {sorted(set(text))}")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise FieldError("text", "format must be an object such as {\"type\": \"json_schema\", \"schema\": {...}}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    raise FieldError("text", f"format type must be text, json_object or json_schema, got {kind!r}")


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion a Responses request runs as."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {
        "model": body.model, "messages": system + history + input_messages(body.input),
        "max_tokens": body.max_output_tokens, "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text), "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None}
    for key in ("temperature", "top_p"):
        if getattr(body, key) is not None:
            chat[key] = float(getattr(body, key))
    return ChatCompletionRequest.model_validate(chat)


def usage(chat_usage: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def message_item(text: str, status: str = "completed", item_id: Optional[str] = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply's message as output items: its text, then one item per call."""
    items = [message_item(message["content"])] if message.get("content") else []
    return items + [call_item(c) for c in message.get("tool_calls") or []]


def as_chat_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the assistant's chat message, to continue the conversation from."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ResponseBuilder:
    """The Response object of one request, from the request and, as it ends, its output."""

    def __init__(self, body: ResponsesRequest, model_name: str) -> None:
        self.body, self.model_name = body, model_name
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def build(self, status: str, output: list[dict[str, Any]], chat_usage: Optional[dict[str, Any]] = None,
              finish_reason: Optional[str] = None, error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        b = self.body
        if status == "completed" and finish_reason == "length":
            status = "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model_name, "output": output, "usage": usage(chat_usage), "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "store": b.store,
            "temperature": 1.0 if b.temperature is None else float(b.temperature),
            "top_p": 1.0 if b.top_p is None else float(b.top_p),
            "text": {"format": (b.text or {}).get("format") or {"type": "text"}},
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [], "truncation": "disabled"}


RunChat = Callable[..., Awaitable[Any]]


def install_responses(app: FastAPI, run_chat: RunChat, check_model: Callable[[Optional[str]], None],
                      model_name: str, reported: Callable[[Any, list[str]], Any],
                      store: Optional[ResponseStore] = None) -> ResponseStore:
    """The routes, over the chat path (`run_chat(chat_body, request, as_payloads)`)."""
    store = store or ResponseStore()
    app.state.response_store = store

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return store.get(response_id, "response_id")[0]

    @app.post("/v1/responses", response_model=None)
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        check_model(body.model)
        history = store.get(body.previous_response_id, "previous_response_id")[1] \
            if body.previous_response_id is not None else []
        try:
            chat = chat_request(body, history)
        except ValueError as e:
            raise APIError(400, str(e), getattr(e, "field", None)) from e
        result = await _run(run_chat, chat, request, body.stream)
        builder = ResponseBuilder(body, body.model or model_name)  # a LoRA adapter's name where it names one
        conversation = history + chat_request_messages(chat, body)
        if body.stream:
            events = ResponseEvents(builder, store if body.store else None, conversation)
            return reported(StreamingResponse(events.sse(result), media_type="text/event-stream"),
                            body.ignored_fields())
        choice = result["choices"][0]
        output = output_items(choice["message"])
        response = builder.build("completed", output, result["usage"], choice["finish_reason"])
        if body.store:
            store.put(response, conversation + as_chat_messages(output))
        return reported(response, body.ignored_fields())

    return store


def chat_request_messages(chat: ChatCompletionRequest, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation a stored response continues from: its messages less the instructions."""
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    return messages[1:] if body.instructions else messages


async def _run(run_chat: RunChat, chat: ChatCompletionRequest, request: Request, stream: bool) -> Any:
    """The chat path's result; its errors name the Responses field they came from."""
    try:
        return await run_chat(chat, request, as_payloads=stream)
    except APIError as e:
        if e.param in FROM_CHAT:
            e.message = e.message.replace(e.param, FROM_CHAT[e.param], 1)
            e.param = FROM_CHAT[e.param]
        raise


class ResponseEvents:
    """A chat stream's chunks as Responses' typed events: an output item opens with the first
    text or call, its deltas follow, and it is done when the next item opens or the stream ends."""

    def __init__(self, builder: ResponseBuilder, store: Optional[ResponseStore],
                 conversation: list[dict[str, Any]]) -> None:
        self.builder, self.store, self.conversation = builder, store, conversation
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self.open: Optional[dict[str, Any]] = None  # the item being written
        self.calls: dict[int, dict[str, Any]] = {}  # a chat call's index -> its item
        self.usage: Optional[dict[str, Any]] = None
        self.finish_reason: Optional[str] = None

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def sse(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        start = self.builder.build("in_progress", [])
        yield self.event("response.created", response=start)
        yield self.event("response.in_progress", response=start)
        try:
            async for chunk in chunks:
                if "error" in chunk:
                    for e in self.close():
                        yield e
                    failed = self.builder.build("failed", self.output, error={
                        "code": "server_error", "message": chunk["error"]["message"]})
                    yield self.event("response.failed", response=failed)
                    return
                for e in self.chunk(chunk):
                    yield e
            for e in self.close():
                yield e
            response = self.builder.build("completed", self.output, self.usage, self.finish_reason)
            if self.store is not None:
                self.store.put(response, self.conversation + as_chat_messages(self.output))
            yield self.event(f"response.{response['status']}", response=response)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        events: list[str] = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                events += self.text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self.call(call)
            self.finish_reason = choice["finish_reason"] or self.finish_reason
        return events

    def text(self, delta: str) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self.close()
            self.open = message_item("", status="in_progress")
            self.open["text"] = ""
            events.append(self.event("response.output_item.added", output_index=len(self.output),
                                     item=self._shown(self.open)))
            events.append(self.event("response.content_part.added", item_id=self.open["id"],
                                     output_index=len(self.output), content_index=0, part=text_part("")))
        self.open["text"] += delta
        return events + [self.event("response.output_text.delta", item_id=self.open["id"],
                                    output_index=len(self.output), content_index=0, delta=delta, logprobs=[])]

    def call(self, call: dict[str, Any]) -> list[str]:
        events = []
        if "id" in call:  # a new call: its name and id, maybe a first piece of its arguments
            events += self.close()
            self.open = call_item({**call, "function": {**call["function"], "arguments": ""}}, "in_progress")
            self.calls[call["index"]] = self.open
            events.append(self.event("response.output_item.added", output_index=len(self.output),
                                     item=dict(self.open)))
        item = self.calls[call["index"]]
        piece = call["function"].get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=len(self.output), delta=piece))
        return events

    def close(self) -> list[str]:
        """The open item's last events; it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = len(self.output), []
        if item["type"] == "message":
            text = item.pop("text")
            item.update(status="completed", content=[text_part(text)])
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=text_part(text))]
        else:
            item["status"] = "completed"
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        self.output.append(item)
        return events + [self.event("response.output_item.done", output_index=index, item=item)]

    @staticmethod
    def _shown(item: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in item.items() if k != "text"}
