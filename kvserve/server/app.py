"""The OpenAI-compatible HTTP API: completions, chat completions (streamed as server-sent
events), the Responses API (kvserve/server/responses.py, run through the chat path), models,
health and Prometheus metrics, over one AsyncEngine. Fields a request sets that kvserve does not
serve go through the field policy (kvserve/server/fields.py): ignored ones are named in the
x-kvserve-ignored-fields header, those that would change the output are a 400.

Errors use OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 for invalid
requests (naming the field), 401 without the API key, 404 for an unknown model, 413 for an
oversized body, 503 with Retry-After when the waiting queue is full.

With an API key set, /v1/* and the tokenizer endpoints need it; /tokenize and /detokenize run on
their own thread with a short queue (503 past it), never on the threads completions tokenize on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hmac
import json
import logging
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.llm_engine import LLMEngine, QueueFullError
from kvserve.engine.outputs import RequestOutput
from kvserve.models.products import make_dense_copies
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.errors import APIError, error_response
from kvserve.server.fields import IGNORED_HEADER, FieldPolicy
from kvserve.server.lora_api import adapter_cards, adapter_names, install_lora_routes, with_adapter
from kvserve.server.args import ServeOptions
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvserve.server.tools import ToolCallParser, ToolPlan, fallback_messages, plan_tools, template_messages, template_takes_tools

logger = logging.getLogger("kvserve.server")
END_STREAMS_BEFORE_S = 0.5  # how long before the grace period ends open streams get their last event
DISCONNECT_POLL_S = 0.25  # how often a response that is not writing anything looks for its client
CLIENT_GONE = "client disconnected"
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")  # what needs the API key when one is set
TOKENIZE_THREADS = 1  # /tokenize and /detokenize: threads of their own (1 MiB of text is seconds) ...
TOKENIZE_MAX_WAITING = 8  # ... and calls queued for them; past it, 503
# completions' prompts: as many threads as asyncio's default executor, but daemons, so a prompt
# still tokenizing when the shutdown grace ends does not hold the process (asyncio.run joins
# the default executor's threads, however long their work takes)
PROMPT_THREADS = min(32, (os.cpu_count() or 1) + 4)


API_FIELDS = {"structured": "response_format"}  # the engine's name of a field -> the API's


def create_app(engine: LLMEngine, model_name: str, api_key: Optional[str] = None,
               max_body_bytes: int = 1 << 20, tool_call_parser: Optional[str] = None,
               engine_thread: bool = True) -> FastAPI:
    """The app; its lifespan starts the engine loop on a thread of its own, or with
    engine_thread False leaves it to the caller (app.state.async_engine.run_here(), as serve())."""
    metrics_holder: dict[str, ServerMetrics] = {}
    aengine = AsyncEngine(engine, on_finished=lambda out: metrics_holder["m"].finished(out),
                          own_thread=engine_thread)
    metrics = ServerMetrics(lambda: aengine.stats)
    metrics_holder["m"] = metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        aengine.stop()
        engine.flush_kv_tiers()  # the pool's prefixes written down for the next start
        app.state.tokenizer_threads.close()
        app.state.prompt_threads.close()

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan)
    app.state.engine, app.state.async_engine, app.state.metrics = engine, aengine, metrics
    _install_guards(app, api_key, max_body_bytes, metrics)
    _install_routes(app, aengine, engine, model_name, metrics, tool_call_parser, api_key is not None)
    return app


def _install_guards(app: FastAPI, api_key: Optional[str], max_body_bytes: int, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        metrics.reject(str(e.status))
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        kind = err.get("type", "")
        # the field as the client named it (json_invalid's loc is an offset; a union's loc adds its member)
        param = None if kind == "json_invalid" else (loc[0] if loc else None)
        msg = "the request body is not valid JSON" if kind == "json_invalid" else \
            f"{param or 'body'}: {err.get('msg', 'invalid value')}"
        if kind == "value_error" and not loc:  # a check over the whole body: its error names the field
            error = err.get("ctx", {}).get("error")
            msg = str(error) if error is not None else str(err.get("msg", "")).removeprefix("Value error, ")
            param = getattr(error, "field", None)
        metrics.reject("400")
        return error_response(APIError(400, msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        metrics.reject(str(e.status_code))
        return error_response(APIError(e.status_code, str(e.detail), kind="invalid_request_error"
                                       if e.status_code < 500 else "server_error"))

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)


class _Guard:
    """API key and body size, as plain ASGI (an @app.middleware("http") wrapper hides client
    disconnects from the routes). The body is counted as it arrives, so a chunked body is held
    to the limit as one with a Content-Length."""

    def __init__(self, app: Any, api_key: Optional[str], max_body_bytes: int, metrics: Any,
                 keyed: tuple[str, ...] = KEYED_PATHS) -> None:
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics
        self.keyed = keyed  # path prefixes that need the key (metrics: anything with reject(status))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if scope["path"].startswith(self.keyed) and self.api_key is not None and not self._authorized(headers):
            self.metrics.reject("401")
            return await error_response(APIError(401, "missing or invalid API key (Authorization: Bearer ...)",
                                                 kind="authentication_error", code="invalid_api_key"))(
                scope, receive, send)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            self.metrics.reject("413")
            return await error_response(self._too_large())(scope, receive, send)
        received, too_large = 0, False

        async def counted() -> dict[str, Any]:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # stop reading; the app's own answer is dropped
                    too_large = True
                    raise self._too_large()
            return message  # type: ignore[no-any-return]

        async def unless_too_large(message: dict[str, Any]) -> None:
            if not too_large:
                await send(message)

        await self.app(scope, counted, unless_too_large)
        if too_large:
            self.metrics.reject("413")
            await error_response(self._too_large())(scope, receive, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        assert self.api_key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def _too_large(self) -> APIError:
        return APIError(413, f"request body larger than {self.max_body_bytes} bytes")


def _install_routes(app: FastAPI, aengine: AsyncEngine, engine: LLMEngine, model_name: str,
                    metrics: ServerMetrics, tool_call_parser: Optional[str], needs_key: bool) -> None:
    from kvserve.server.bounded import BoundedThreads
    tokenizer = engine.tokenizer
    app.state.tokenizer_threads = side = BoundedThreads("/tokenize and /detokenize", TOKENIZE_THREADS,
                                                        TOKENIZE_MAX_WAITING)
    app.state.prompt_threads = shared = BoundedThreads("prompt tokenizing", PROMPT_THREADS, None)

    def check_model(name: Optional[str]) -> None:
        """The base model or a loaded LoRA adapter (kvserve.server.lora_api), else a 404."""
        if name is not None and name != model_name and name not in adapter_names(engine):
            adapters = f" and the LoRA adapters {adapter_names(engine)}" if engine.lora is not None else ""
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{model_name}'{adapters}",
                           "model", "NotFoundError", "model_not_found")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/kv/state")
    async def kv_cache_state() -> dict[str, Any]:
        """Every block's status, reference count and hash; each request's block tables and
        tokens; the pool's totals (kvserve/engine/kv_state.py documents the fields)."""
        from kvserve.engine.kv_state import kv_state
        return await aengine.call(kv_state)  # type: ignore[no-any-return]

    from kvserve.server.kv_events_api import install_kv_event_routes
    install_kv_event_routes(app, aengine, engine)  # GET /v1/kv/events

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """The live view of the cache (it reads /v1/kv/state with the key typed into it)."""
        page = _static("dashboard.html").replace("__NEEDS_KEY__", "true" if needs_key else "false")
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "kvserve",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(), *adapter_cards(engine, model_name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return next((c for c in adapter_cards(engine, model_name) if c["id"] == model_id), model_card())

    install_lora_routes(app, aengine, engine, model_name)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter

    policy = FieldPolicy(logger)

    def reported(response: Any, ignored: list[str]) -> Any:
        """The response, with the fields it ignored named in a header (and logged once each)."""
        value = policy.report(ignored)
        if value is None:
            return response
        if not isinstance(response, StreamingResponse):
            response = JSONResponse(response)
        response.headers[IGNORED_HEADER] = value
        return response

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from e
        if any(not p for p in prompts):
            raise APIError(400, "prompt: must not be empty", "prompt")
        # echo with logprobs scores the prompt too; echo with max_tokens 0 only scores it
        prompt_logprobs = (body.logprobs or 0) if body.echo and (body.logprobs is not None or body.max_tokens == 0) \
            else None
        # 16: OpenAI's and vLLM's default
        params = with_adapter(_params(body, body.logprobs, 16, prompt_logprobs), body.model, engine)
        ids = [await _tokenize("prompt", tokenizer.encode, p, shared)
               if isinstance(p, str) and tokenizer is not None else p
               for p in prompts]  # off the event loop and the engine thread
        echo = [p if isinstance(p, str) else None for p in prompts] if body.echo else None
        if len(ids) > 1:
            return reported(await _respond_many(aengine, body, ids, params, request, model_name, tokenizer, echo),
                            body.ignored_fields())
        return reported(await _respond(aengine, body, ids[0], params, request, model_name, chat=False,
                                       tokenizer=tokenizer, echo=echo[0] if echo else None), body.ignored_fields())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "prompt")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if body.messages is not None:
            if not tokenizer.chat_template:
                raise APIError(400, "this model has no chat template", "messages")
            try:
                messages = [m.for_template() for m in body.messages]
            except ValueError as e:
                raise APIError(400, str(e), "messages") from e
            ids = await _tokenize("messages", tokenizer.encode_chat, messages, side)
        else:
            ids = await _tokenize("prompt", lambda p: tokenizer.encode(p, add_special_tokens=body.add_special_tokens),
                                  body.prompt, side)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        vocab = engine.model_config.vocab_size
        if tokenizer is None or any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {vocab})", "tokens")
        return {"prompt": await _tokenizer_call(tokenizer.decode, body.tokens, side)}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return reported(await run_chat(body, request), body.ignored_fields())

    async def run_chat(body: ChatCompletionRequest, request: Request, as_payloads: bool = False) -> Any:
        """A chat completion: its body, or its stream (with as_payloads its chunks as dicts)."""
        check_model(body.model)
        if tokenizer is None or not tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer.chat_template,
                              tool_call_parser)
            messages, tools = _chat_input(body, plan, tokenizer.chat_template)
        except ValueError as e:
            raise APIError(400, str(e), getattr(e, "field", None)) from e
        ids = await _tokenize("messages", lambda m: tokenizer.encode_chat(m, tools), messages, shared)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        # without max_tokens a chat reply may take the rest of the context, as OpenAI's and vLLM's
        rest = max(engine.max_seq_len - len(ids), 1) if not engine.unbounded else 1 << 20
        params = with_adapter(_params(body, (body.top_logprobs or 0) if body.logprobs else None, min(rest, 1 << 20)),
                              body.model, engine)
        if plan is not None and plan.schema is not None:  # a forced call: the output held to its schema
            if params.structured is not None:
                raise APIError(400, "tool_choice: a forced tool call cannot be combined with response_format "
                               "or guided_*", "tool_choice")
            try:
                params = dataclasses.replace(params, structured=("json_schema", plan.schema))
            except ValueError as e:
                raise APIError(400, f"tool_choice: {e}", "tool_choice") from e
        return await _respond(aengine, body, ids, params, request, model_name, chat=True, tokenizer=tokenizer,
                              tools=plan, as_payloads=as_payloads)

    from kvserve.server.responses import install_responses
    install_responses(app, run_chat, check_model, model_name, reported)


def _chat_input(body: ChatCompletionRequest, plan: Optional[ToolPlan],
                template: str) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """The messages and tools as the template is given them: a template that renders tools gets
    them (and earlier calls) its way; any other gets them written into the conversation."""
    messages = [m.for_template() for m in body.messages]
    if template_takes_tools(template):
        return template_messages(messages), [t.as_openai() for t in plan.tools] if plan else None
    return fallback_messages(messages, plan.tools if plan else ()), None


async def _tokenize(field: str, encode: Any, value: Any, threads: Any) -> list[int]:
    """Tokens of a request's text, in a worker thread; text that cannot be encoded (a lone
    surrogate) is a 400 naming the field."""
    try:
        return await _tokenizer_call(encode, value, threads)  # type: ignore[no-any-return]
    except (UnicodeError, ValueError, TypeError) as e:
        raise APIError(400, f"{field}: cannot be tokenized ({type(e).__name__}: {e})"[:500], field) from e


async def _tokenizer_call(fn: Any, value: Any, threads: Any) -> Any:
    """fn(value) off the event loop, on `threads` (a BoundedThreads: 503 with Retry-After when
    they are busy)."""
    from kvserve.server.bounded import Busy
    try:
        return await threads.run(fn, value)
    except Busy as e:
        raise APIError(503, str(e), kind="server_overloaded", code="busy", headers={"Retry-After": "1"}) from e


def _params(body: Any, logprobs: Optional[int], default_max_tokens: int, prompt_logprobs: Optional[int] = None) -> Any:
    try:
        return body.sampling_params(default_max_tokens, logprobs, prompt_logprobs)
    except ValueError as e:  # SamplingParams names the field it refuses (OptionError.field)
        raise APIError(400, str(e), getattr(e, "field", None)) from e


async def _start(aengine: AsyncEngine, rid: str, body: Any, prompt: Any, params: Any,
                 chat: bool) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
    stream = aengine.generate(rid, prompt, params, body.priority, body.cache_salt)
    try:
        return await stream.__anext__(), stream
    except QueueFullError as e:
        raise APIError(503, str(e), kind="server_overloaded", code="queue_full", headers={"Retry-After": "1"}) from e
    except ValueError as e:  # the engine's FieldError names its field (SamplingParams.structured: response_format)
        field = API_FIELDS.get(getattr(e, "field", ""), getattr(e, "field", None)) or ("messages" if chat else "prompt")
        raise APIError(400, str(e), field) from e


class _AbortOnDisconnect:
    """Aborts a response's requests once its client has gone, whether or not they have produced
    anything: a request still waiting for a seat, or one that makes no progress, would otherwise
    hold its place and blocks until an output showed the disconnect. The abort ends the handler's
    wait with a last output (CLIENT_GONE); aborts are repeated while the response lives, so a
    request added after the client left is ended too."""

    def __init__(self, request: Request, aengine: AsyncEngine) -> None:
        self.request, self.aengine = request, aengine
        self.request_ids: list[str] = []
        self._task: Optional[asyncio.Task[None]] = None

    async def __aenter__(self) -> "_AbortOnDisconnect":
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _watch(self) -> None:
        while not await self.request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        while True:
            for rid in self.request_ids:
                self.aengine.abort(rid, CLIENT_GONE)
            await asyncio.sleep(DISCONNECT_POLL_S)


async def _finish(first: RequestOutput, stream: AsyncIterator[RequestOutput], request: Request) -> RequestOutput:
    last = first
    gone = _DisconnectCheck(request)
    try:
        async for out in stream:
            last = out
            if await gone():
                break
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    if not last.finished or last.error == CLIENT_GONE:
        raise APIError(499, CLIENT_GONE, kind="client_closed_request")
    if last.error:
        raise APIError(500, last.error, kind="server_error")
    return last


async def _respond(aengine: AsyncEngine, body: Any, prompt: Any, params: Any, request: Request,
                   model_name: str, chat: bool, tokenizer: Any, echo: Optional[str] = None,
                   tools: Optional[ToolPlan] = None, as_payloads: bool = False) -> Any:
    """One request's response: a body, or a stream (as SSE, or with as_payloads its chunks as dicts)."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    async with _AbortOnDisconnect(request, aengine) as watch:  # a stream watches from here on
        watch.request_ids.append(rid)
        first, stream = await _start(aengine, rid, body, prompt, params, chat)
        fmt = _Formatter(rid, _served(params, model_name), chat, tokenizer, bool(body.echo) if not chat else False,
                         echo, tools, num_top=params.logprobs)
        if body.stream and first.error != CLIENT_GONE:
            parts = [_Part(fmt, first, stream)]
            if as_payloads:
                return _payloads(parts, request, _Usage.of(body))
            return StreamingResponse(_sse(parts, request, _Usage.of(body)), media_type="text/event-stream")
        return fmt.full(await _finish(first, stream, request))


def _served(params: Any, model_name: str) -> str:
    """The model a response names: the LoRA adapter the request ran, or the base model."""
    return params.lora_request.lora_name if params.lora_request is not None else model_name


async def _respond_many(aengine: AsyncEngine, body: Any, prompts: list[Any], params: Any, request: Request,
                        model_name: str, tokenizer: Any, echo: Optional[list[Optional[str]]]) -> Any:
    """Several prompts in one completion request: each runs as its own request (batched by the
    engine); their choices are numbered prompt by prompt, n each, as OpenAI and vLLM do. A
    stream interleaves their chunks as they come."""
    rid = f"cmpl-{uuid.uuid4().hex}"
    started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]] = []
    fmts = [_Formatter(rid, _served(params, model_name), False, tokenizer, bool(body.echo), echo[i] if echo else None,
                       offset=i * params.n, num_top=params.logprobs) for i in range(len(prompts))]
    try:
        async with _AbortOnDisconnect(request, aengine) as watch:  # a stream watches from here on
            for i, p in enumerate(prompts):
                watch.request_ids.append(f"{rid}-{i}")
                started.append(await _start(aengine, f"{rid}-{i}", body, p, params, False))
            if body.stream and all(first.error != CLIENT_GONE for first, _ in started):
                parts = [_Part(f, first, stream) for f, (first, stream) in zip(fmts, started)]
                response = StreamingResponse(_sse(parts, request, _Usage.of(body)), media_type="text/event-stream")
                started = []  # the stream owns them now
                return response
            outs = await asyncio.gather(*(_finish(first, stream, request) for first, stream in started))
    finally:
        for _, stream in started:
            await stream.aclose()  # type: ignore[attr-defined]
    bodies = [f.full(out) for f, out in zip(fmts, outs)]
    return {**bodies[0], "choices": [c for b in bodies for c in b["choices"]],
            "usage": _summed_usage([b["usage"] for b in bodies])}


def _summed_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """One usage for several prompts' requests: every count summed."""
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}}


@dataclasses.dataclass
class _Part:
    """One engine request of a response: how it is written, its first output and the rest."""
    fmt: "_Formatter"
    first: RequestOutput
    stream: AsyncIterator[RequestOutput]
    last: Optional[RequestOutput] = None


async def _outputs(parts: list[_Part]) -> AsyncIterator[tuple[_Part, RequestOutput]]:
    """Every part's outputs, first ones first, then as each comes."""
    if len(parts) == 1:  # one request: read it directly
        p = parts[0]
        yield p, p.first
        out = p.first
        while not out.finished:
            out = await p.stream.__anext__()
            yield p, out
        return
    pending: dict[Any, _Part] = {}
    for p in parts:
        yield p, p.first
        if not p.first.finished:
            pending[asyncio.ensure_future(p.stream.__anext__())] = p  # type: ignore[arg-type]
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                p = pending.pop(task)
                out = task.result()
                yield p, out
                if not out.finished:
                    pending[asyncio.ensure_future(p.stream.__anext__())] = p  # type: ignore[arg-type]
    finally:
        for task in pending:
            task.cancel()


@dataclasses.dataclass(frozen=True)
class _Usage:
    """What a stream reports of usage: a last chunk with the totals (include_usage), and the
    usage so far in every chunk (vLLM's continuous_usage_stats)."""
    at_end: bool = False
    continuous: bool = False

    @staticmethod
    def of(body: Any) -> "_Usage":
        o = body.stream_options
        return _Usage(bool(o and o.include_usage), bool(o and o.continuous_usage_stats))


async def _sse(parts: list[_Part], request: Request, usage: _Usage) -> AsyncIterator[str]:
    async for payload in _payloads(parts, request, usage):
        yield _event(payload)
    yield "data: [DONE]\n\n"


async def _payloads(parts: list[_Part], request: Request, usage: _Usage) -> AsyncIterator[dict[str, Any]]:
    """A stream's chunks as dicts (an error as {"error": ...}); the requests are closed at the end."""
    def chunk(p: _Part, choices: list[dict[str, Any]], out: RequestOutput) -> dict[str, Any]:
        return p.fmt.chunk(choices, usage=p.fmt.usage(out) if usage.continuous else None)
    try:
        for p in parts:
            p.last = p.first
            if p.fmt.chat:
                yield chunk(p, [{"index": p.fmt.offset + i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None} for i in range(p.fmt.n(p.first))], p.first)
            elif p.fmt.echo:
                want = any(c.logprobs is not None for c in p.first.outputs) or p.first.prompt_logprobs is not None
                yield chunk(p, p.fmt.echo_choices(p.first, want), p.first)
        gone = _DisconnectCheck(request)
        async for p, out in _outputs(parts):
            p.last = out
            choices = p.fmt.delta_choices(out)
            if choices:
                yield chunk(p, choices, out)
            if not out.finished and await gone():
                return
        for p in parts:
            out = p.last
            assert out is not None
            if out.error:  # the request failed: every choice ends with finish_reason "error", then the error
                if not out.outputs:  # ended from outside the engine (shutdown): no choice has ended yet
                    yield chunk(p, [p.fmt.ended(i, "error") for i in range(p.fmt.n(p.first))], out)
                yield {"error": {"message": out.error, "type": "server_error", "param": None, "code": 500}}
        if usage.at_end:
            total = _summed_usage([p.fmt.usage(p.last) for p in parts if p.last is not None])
            yield parts[0].fmt.chunk([], usage=total)
    finally:
        for p in parts:  # a disconnect lands here: the requests are aborted, their blocks freed
            try:
                await p.stream.aclose()  # type: ignore[attr-defined]
            except RuntimeError:  # its read was in flight and is cancelled: that ends (aborts) it instead
                pass


class _DisconnectCheck:
    """Whether a response's client has gone, asked after each output but looked up at most every
    DISCONNECT_POLL_S: Starlette's lookup (a receive under a cancelled scope) cost about as much
    as the rest of a streamed token's handling, and a client that left is still noticed within
    the poll interval, as a response that writes nothing notices it (_AbortOnDisconnect)."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.next_check = time.monotonic() + DISCONNECT_POLL_S

    async def __call__(self) -> bool:
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + DISCONNECT_POLL_S
        return await self.request.is_disconnected()


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Formatter:
    """OpenAI's bodies and chunks for one engine request: its choices numbered from `offset`;
    with a tool plan, each chat choice's text goes through its own tool-call parser."""

    def __init__(self, rid: str, model: str, chat: bool, tokenizer: Any, echo: bool = False,
                 echo_text: Optional[str] = None, tools: Optional[ToolPlan] = None, offset: int = 0,
                 num_top: Optional[int] = None) -> None:
        self.rid, self.model, self.chat, self.tokenizer = rid, model, chat, tokenizer
        self.echo, self.echo_text = echo, echo_text  # completions: the prompt's text comes first
        self.tools, self.offset = tools, offset
        self.num_top = num_top or 0  # chat: top_logprobs per position
        self.parsers: dict[int, ToolCallParser] = {}  # a stream's parser per choice
        self.held: dict[int, list[dict[str, Any]]] = {}  # a stream's logprobs of text a parser holds back
        self.created = int(time.time())

    def prompt_text(self, out: RequestOutput) -> str:
        if self.echo_text is not None:
            return self.echo_text
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    def prompt_logprobs(self, out: RequestOutput, want: bool) -> Optional[dict[str, Any]]:
        """The prompt's tokens with their logprobs (the first has none) and top logprobs."""
        if not want:
            return None
        rows = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return self._logprobs(out.prompt_token_ids, [r or {} for r in rows], 0, first_is_none=True)

    @staticmethod
    def n(out: RequestOutput) -> int:
        return max(len(out.outputs), 1)

    def ended(self, index: int, reason: str) -> dict[str, Any]:
        """A choice's last chunk, with nothing more in it."""
        body = {"delta": {}} if self.chat else {"text": ""}
        return {"index": self.offset + index, **body, "logprobs": None, "finish_reason": reason}

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        completion = sum(len(c.token_ids) for c in out.outputs)
        prompt = len(out.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens}}

    def chunk(self, choices: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        payload: dict[str, Any] = {"id": self.rid, "object": obj, "created": self.created,
                                   "model": self.model, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return payload

    def echo_choices(self, out: RequestOutput, logprobs: bool) -> list[dict[str, Any]]:
        """A stream's first chunk with echo: each choice starts with the prompt."""
        lp = self.prompt_logprobs(out, logprobs)
        return [{"index": self.offset + i, "text": self.prompt_text(out), "logprobs": lp, "finish_reason": None}
                for i in range(self.n(out))]

    def delta_choices(self, out: RequestOutput) -> list[dict[str, Any]]:
        choices = []
        for c in out.outputs:
            if not c.delta and not c.finished:
                continue
            lp = self._logprobs(c.delta_token_ids, c.logprobs, len(c.token_ids) - len(c.delta_token_ids))
            index = self.offset + c.index
            if not self.chat:
                choices.append({"index": index, "text": c.delta, "logprobs": lp, "finish_reason": c.finish_reason})
                continue
            delta: dict[str, Any] = {"content": c.delta} if c.delta else {}
            reason = c.finish_reason
            if self.tools is not None:
                parser = self.parsers.setdefault(c.index, self.tools.parser())
                parsed = parser.feed(c.delta)
                if c.finished:
                    rest = parser.finish()
                    parsed.content, parsed.calls = parsed.content + rest.content, parsed.calls + rest.calls
                delta = {"content": parsed.content} if parsed.content else {}
                if parsed.calls:
                    delta["tool_calls"] = parsed.calls
                reason = _tool_reason(reason, parser)
                lp = self._held_back(c.index, lp, bool(delta) or reason is not None)
                if lp is False:  # nothing to say yet: no empty delta is sent
                    continue
            choices.append({"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason})
        return choices

    def _held_back(self, index: int, lp: Optional[dict[str, Any]], sends: bool) -> Any:
        """A chat chunk's logprobs, with those of tokens whose text a tool parser held back
        before it; False when the chunk would be empty (its logprobs wait for the next one)."""
        held = self.held.setdefault(index, [])
        if lp is not None:
            held += lp["content"]
        if not sends:
            return False
        self.held[index] = []
        return {"content": held} if lp is not None else None

    def full(self, out: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            index = self.offset + c.index
            if self.chat:
                lp = self._logprobs(c.token_ids, c.logprobs, 0)
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                reason = c.finish_reason
                if self.tools is not None:  # the same parser a stream uses, fed the whole text
                    parser = self.tools.parser()
                    content = parser.feed(c.text).content + parser.finish().content
                    message["content"] = content if content or not parser.calls else None
                    if parser.calls:
                        message["tool_calls"] = parser.calls
                    reason = _tool_reason(reason, parser)
                choices.append({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
                continue
            text, lp = c.text, None
            if self.echo:  # the prompt first: its text, and its tokens' logprobs before the output's
                prompt = self.prompt_text(out)
                text = prompt + c.text
                lp = _joined(self.prompt_logprobs(out, c.logprobs is not None),
                             self._logprobs(c.token_ids, c.logprobs, 0, len(prompt)))
            else:
                lp = self._logprobs(c.token_ids, c.logprobs, 0)
            choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage(out)}

    def _logprobs(self, ids: list[int], lps: Optional[list[dict[int, float]]], start: int, offset: int = 0,
                  first_is_none: bool = False) -> Optional[dict]:
        """OpenAI's logprobs of tokens `ids` (rows from `start` of lps); for completions the
        character offset of each token in the choice's text, counted from `offset`."""
        if lps is None:
            return None
        rows = lps[start:start + len(ids)]
        tok = (lambda i: self.tokenizer.decode([i], skip_special_tokens=False)) if self.tokenizer else str
        if self.chat:  # the rows hold the top k first, then the sampled token when not among them
            return {"content": [{**_token_entry(tok(t), r.get(t)),
                                 "top_logprobs": [_token_entry(tok(k), v) for k, v in list(r.items())[:self.num_top]]}
                                for t, r in zip(ids, rows)]}
        tokens = [tok(t) for t in ids]
        offsets = []  # where each token's text starts: the length of the text of the tokens before it
        if self.tokenizer is not None:
            from kvserve.engine.output_processor import IncrementalDetokenizer
            text = IncrementalDetokenizer(self.tokenizer)
            offsets = [offset + len(text.text(ids[:i])) for i in range(len(ids))]
        none_first = first_is_none and bool(ids)
        return {"tokens": tokens,
                "token_logprobs": [None if none_first and i == 0 else r.get(t)
                                   for i, (t, r) in enumerate(zip(ids, rows))],
                "top_logprobs": [None if none_first and i == 0 else {tok(k): v for k, v in r.items()}
                                 for i, r in enumerate(rows)],
                "text_offset": offsets}


def _token_entry(text: str, logprob: Optional[float]) -> dict[str, Any]:
    """Chat's logprob entry: the token, its logprob and its text's UTF-8 bytes."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}


def _tool_reason(reason: Optional[str], parser: ToolCallParser) -> Optional[str]:
    """A choice that ended by itself having made calls ends with "tool_calls", as OpenAI's."""
    return "tool_calls" if reason == "stop" and parser.calls else reason


def _joined(a: Optional[dict[str, Any]], b: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Two completions logprobs objects, one after the other."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def serve(model: str, engine_options: dict[str, Any], o: ServeOptions) -> int:
    """Serve an engine built from flat options (from `kvserve serve`'s flags, which bound the
    waiting queue and log stats by default: SERVE_ENGINE_DEFAULTS).

    The engine's loop runs on this thread, the one that loaded the model, and HTTP on another
    (kvserve.server.async_engine says why); SIGINT and SIGTERM start the graceful shutdown."""
    import signal

    import uvicorn

    from kvserve.config import env_api_key
    logging.basicConfig(level=o.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine.from_options(model, **engine_options)
    if made := make_dense_copies(engine.model):  # before listening: else the first long prompt waits for them
        logger.info("dense copies of packed weights made: %.1f MB", made / 1e6)
    name = o.served_model_name or _default_name(model)
    api_key = o.api_key or env_api_key()
    app = create_app(engine, name, api_key, o.max_body_bytes, o.tool_call_parser, engine_thread=False)
    logger.info("serving %s on http://%s:%d (%d KV blocks of %d tokens, %s auth)", name, o.host, o.port,
                engine.plan.num_blocks, engine.plan.block_size, "API-key" if api_key else "no")
    # the grace period as given (fractions too); streams still open near its end are ended with
    # an error event and [DONE] rather than cut
    config = uvicorn.Config(app, host=o.host, port=o.port, log_level=o.log_level,
                            timeout_graceful_shutdown=o.shutdown_timeout)  # type: ignore[arg-type]
    server = _GracefulServer(config)
    server.before_cut = (max(o.shutdown_timeout - END_STREAMS_BEFORE_S, 0.0),
                         lambda: app.state.async_engine.end_all("the server is shutting down"))
    http = _HttpThread(server)
    in_main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if in_main else {}
    try:
        http.start()
        app.state.async_engine.run_here(until=lambda: not http.is_alive())
        http.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    gc.freeze()  # the interpreter's exit then skips a last collection over every object (0.3 -> 0.1 s)
    return http.exit_code


class _HttpThread(threading.Thread):
    """uvicorn's server on a thread of its own (its signal handlers are the caller's to set: the
    server's handle_exit). exit_code: 0, or where it failed the status uvicorn exited with (3 for
    a port in use) or 1."""

    def __init__(self, server: Any) -> None:
        super().__init__(name="kvserve-http", daemon=True)
        self.server, self.exit_code = server, 0

    def run(self) -> None:
        import torch
        torch.set_num_threads(1)  # no OpenMP pool of its own beside the engine's (async_engine.py)
        try:
            self.server.run()
            if not self.server.started:
                self.exit_code = 1
        except SystemExit as e:
            self.exit_code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            logger.exception("the HTTP server failed")
            self.exit_code = 1


def _graceful_server_class():  # type: ignore[no-untyped-def]
    import contextlib
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """SIGTERM/SIGINT start uvicorn's graceful shutdown (stop accepting, let in-flight
        requests finish within the timeout, then cancel them); the process then exits 0
        instead of re-raising the signal."""

        before_cut = None  # (seconds into the shutdown, what to call then)

        async def shutdown(self, sockets=None):  # type: ignore[no-untyped-def]
            import asyncio
            if self.before_cut is not None:
                delay, call = self.before_cut
                asyncio.get_running_loop().call_later(delay, call)
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]
            if threading.current_thread() is not threading.main_thread():  # serve() set them
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _GracefulServer(config):  # type: ignore[no-untyped-def]
    return _graceful_server_class()(config)


def _static(name: str) -> str:
    from importlib.resources import files
    return files("kvserve.server").joinpath("static", name).read_text(encoding="utf-8")


def _default_name(model: str) -> str:
    import os
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


__all__ = ["create_app", "serve"]
