"""One OpenAI endpoint over several `kvserve serve` replicas, routed by where each request's
prefix already is.

Each replica's prefix cache only helps the requests that reach it. The router follows every
replica's KV events (GET /v1/kv/events, a long poll; `kvserve.server.kv_view`), so it knows the
blocks each one holds in its pool and in its tiers below, named as the engine names them. A
request is tokenized with the model's tokenizer and its blocks named by the engine's own chain
hashes (kvserve.core.block_hash, seeded by the model's namespace and the request's cache_salt),
and it goes to the replica with the lowest cost, as NVIDIA Dynamo's KV router weighs it:

    cost(replica) = overlap_weight * (blocks to prefill there) + (blocks of requests in flight there)

where the blocks to prefill are the request's blocks less the leading ones the replica holds
(a block in a tier counts as partly held: it is loaded, not computed). A request whose tokens
the router cannot tell (no tokenizer, or a body it cannot read) goes by load alone. Requests of
different cache_salt share no block names, so one tenant's traffic never decides where
another's goes.

The front is guarded as a server is (`kvserve.server.app`'s guard): the same body limit, counted
as a chunked body arrives; the same key rules, with /router/state behind the key too. A client
that leaves closes its request to the replica, which aborts it; on shutdown open requests get
`--shutdown-timeout`, then are closed.

A replica that fails (connection refused or closed, or its /health failing) is taken out at
once; requests it had not begun to answer go to another replica, a stream it had begun ends
with an error event, and a health check brings it back when it answers again. Nothing waits on
a dead replica longer than the connect timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence, TypeVar
from urllib.parse import urlsplit

from fastapi import Request  # the routes' parameter type, resolved from this module's names

from kvserve.config import OptionError, check_at_least, check_seconds
from kvserve.server.args import ServeOptions, check_port
from kvserve.server.kv_view import ReplicaBlocks

logger = logging.getLogger("kvserve")

KEYED_PATHS = ("/v1", "/router/")  # what needs the API key when one is set
EVENT_POLL_S = 1.0  # how long one long poll of a replica's events may wait
T = TypeVar("T")


def cache_salt_of(body: dict[str, Any]) -> Optional[str]:
    """The request's cache_salt, as the replica's engine seeds its block hashes with it."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) else None


def request_tokens(tokenizer: Any, path: str, body: dict[str, Any]) -> Optional[list[int]]:
    """The prompt's token ids as the replica will see them (a batch: its first prompt), or None
    where the router cannot tell (no tokenizer, a body it cannot read)."""
    if tokenizer is None:
        return None
    try:
        if path.endswith("/chat/completions"):
            messages = [{"role": m.get("role"), "content": _text_of(m.get("content"))}
                        for m in body.get("messages") or [] if isinstance(m, dict)]
            return list(tokenizer.encode_chat(messages)) if messages and tokenizer.chat_template else None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # a batch goes where its first prompt's prefix is
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
    except Exception as e:  # a body the replica will refuse: it is routed by load, and refused there
        logger.debug("cannot tokenize a request for routing: %s", e)
    return None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


@dataclass
class Replica:
    index: int
    url: str
    alive: bool = True
    in_flight: int = 0
    active_blocks: int = 0  # blocks of the requests in flight there (the load a cost weighs)
    num_routed: int = 0
    num_failed: int = 0
    last_error: Optional[str] = None


@dataclass
class RoutingPolicy:
    overlap_weight: float = 1.0  # a block to prefill against a block of load (Dynamo's overlap_score_weight)

    def __post_init__(self) -> None:
        w = self.overlap_weight
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 <= w < float("inf"):
            raise OptionError("overlap_weight", f"must be a number >= 0, got {w!r}")


def check_replica_url(url: str) -> None:
    """A replica is named by its base URL: http(s)://host[:port] (a path is kept as its prefix)."""
    parts = urlsplit(url)
    try:
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # a port that is no number, or past 65535
        valid = False
    if not valid:
        raise OptionError("replica", f"must be a server's URL, as http://HOST:PORT, got {url!r}")


@dataclass
class Router:
    """Which replica serves a request (`choose`), and what the router knows of them: their KV
    blocks (`views`, fed by their events) and their load."""

    urls: Sequence[str]
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    tokenizer: Any = None  # the model's (kvserve.tokenizer); None: every request routed by load

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("the router needs at least one replica")
        for url in self.urls:
            check_replica_url(url)
        self.replicas = [Replica(i, u.rstrip("/")) for i, u in enumerate(self.urls)]
        self.views = [ReplicaBlocks() for _ in self.replicas]
        self.num_cache_routed = self.num_load_routed = self.num_rerouted = 0
        self.num_rejected: Counter[str] = Counter()  # requests the guard refused, by status

    def live(self, exclude: Sequence[int] = ()) -> list[Replica]:
        return [r for r in self.replicas if r.alive and r.index not in exclude]

    def block_names(self, token_ids: Optional[Sequence[int]], cache_salt: Optional[str]) -> list[bytes]:
        """The request's block names as the replicas' engines name them (none until one answered)."""
        if token_ids is None:
            return []
        view = next((v for v in self.views if v.namespace is not None), None)
        return view.request_names(token_ids, cache_salt) if view is not None else []

    def cost(self, replica: Replica, names: Sequence[bytes]) -> float:
        overlap = self.views[replica.index].overlap(names)
        return self.policy.overlap_weight * (len(names) - overlap) + replica.active_blocks

    def choose(self, names: Sequence[bytes], exclude: Sequence[int] = ()) -> Optional[Replica]:
        """The replica for a request with these block names (None: none is alive); its blocks
        then count as held there until its own events say so."""
        live = self.live(exclude)
        if not live:
            return None
        chosen = min(live, key=lambda r: (self.cost(r, names), r.in_flight, r.num_routed))
        if names and self.views[chosen.index].overlap(names[:1]) > 0:
            self.num_cache_routed += 1
        else:
            self.num_load_routed += 1
        self.views[chosen.index].predict(names)
        chosen.num_routed += 1
        return chosen

    def mark_dead(self, replica: Replica, error: str) -> None:
        if replica.alive:
            logger.warning("replica %d (%s) is out: %s", replica.index, replica.url, error)
        replica.alive, replica.last_error = False, error
        replica.num_failed += 1
        self.views[replica.index].reset()  # its cache is gone with it; its events start anew

    def reject(self, status: str) -> None:
        """The guard's count of what it refused (a server's metrics take the same call)."""
        self.num_rejected[status] += 1


# ---- the HTTP front ----
class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """work's result; ClientGone, with work cancelled, if the client disconnects first (its
    body already read, the next thing the server can receive from it is the disconnect).
    Cancelling a request to a replica drops its connection, and the replica aborts it."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((task, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Upstream:
    """A request to a replica, counted in its load from start to release(); release() closes
    the replica's response, once, in a task of its own, so that a caller being cancelled (a
    client gone, a shutdown's end) cannot leave the connection open and the replica working."""

    def __init__(self, replica: Replica, closing: set[asyncio.Task[None]], num_blocks: int) -> None:
        self.replica, self._closing, self.num_blocks = replica, closing, num_blocks
        self.response: Any = None  # the replica's httpx response, once its headers have come
        self._released = False
        replica.in_flight += 1
        replica.active_blocks += num_blocks

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.replica.in_flight -= 1
        self.replica.active_blocks -= self.num_blocks
        if self.response is not None:
            task = asyncio.ensure_future(self.response.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            await asyncio.shield(task)


class _Front:
    """The router's HTTP side: each request to the replica `Router.choose` picks, its answer
    relayed (a stream as it comes), another replica tried when one fails before answering."""

    def __init__(self, router: Router, connect_timeout_s: float, read_timeout_s: float) -> None:
        import httpx
        self.router, self.connect_timeout_s = router, connect_timeout_s
        self.timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self.probe_timeout = httpx.Timeout(5 * connect_timeout_s, connect=connect_timeout_s)
        self.client: Any = None
        self.closing: set[asyncio.Task[None]] = set()
        self.ending = False  # shutting down: streams end at their next event boundary

    def end_streams(self) -> None:
        """Near the end of the shutdown grace: each open stream gets an error event and [DONE]
        after the event it is relaying, and its replica's request is closed (as a server's)."""
        self.ending = True

    async def forward(self, request: Request, path: str) -> Any:
        import httpx
        from kvserve.server.app import APIError
        raw = await request.body()  # the guard holds it to the body limit
        body = _json_object(raw)
        tokens = await asyncio.to_thread(request_tokens, self.router.tokenizer, path, body)
        names = self.router.block_names(tokens, cache_salt_of(body))
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        tried: list[int] = []
        while (replica := self.router.choose(names, tried)) is not None:
            tried.append(replica.index)
            try:
                return await self._via(replica, request, path, raw, headers, bool(body.get("stream")), len(names))
            except httpx.HTTPError as e:
                self.router.mark_dead(replica, f"{type(e).__name__}: {e}")
                self.router.num_rerouted += 1
            except ClientGone:
                raise APIError(499, "client disconnected", kind="client_closed_request") from None
        raise APIError(503, "no replica is available to serve this request", kind="server_error")

    async def _via(self, replica: Replica, request: Request, path: str, raw: bytes, headers: dict[str, str],
                   stream: bool, num_blocks: int) -> Any:
        """The replica's answer (HTTPError: it failed before answering; ClientGone: the client left first)."""
        from fastapi.responses import Response, StreamingResponse
        from starlette.background import BackgroundTask
        upstream = _Upstream(replica, self.closing, max(num_blocks, 1))
        relayed = False
        try:
            sent = self.client.build_request("POST", replica.url + path, content=raw, headers=headers)
            upstream.response = await unless_client_leaves(request, self.client.send(sent, stream=True))
            answer = upstream.response
            where = {"x-kvserve-replica": str(replica.index)}
            if stream and answer.status_code == 200:
                relayed = True  # the stream releases it, however it ends
                return StreamingResponse(self._relay(upstream), media_type="text/event-stream", headers=where,
                                         background=BackgroundTask(upstream.release))
            content = await unless_client_leaves(request, answer.aread())
            return Response(content, status_code=answer.status_code, headers=where,
                            media_type=answer.headers.get("content-type"))
        finally:
            if not relayed:
                await upstream.release()

    async def _relay(self, upstream: _Upstream) -> AsyncIterator[bytes]:
        import httpx
        replica = upstream.replica
        try:
            async for chunk in upstream.response.aiter_raw():
                yield chunk
                if self.ending and chunk.endswith(b"\n\n"):
                    yield _last_event("the router is shutting down", 503)
                    return
        except httpx.HTTPError as e:
            self.router.mark_dead(replica, f"{type(e).__name__}: {e}")
            yield _last_event(f"replica {replica.index} failed mid-stream: {type(e).__name__}", 502)
        finally:  # a client gone mid-stream lands here: the replica's request is closed, so aborted
            await upstream.release()

    async def check_health(self, interval_s: float) -> None:
        import httpx
        while True:
            for r in self.router.replicas:
                err: Optional[str] = None
                try:
                    got = await self.client.get(r.url + "/health", timeout=self.connect_timeout_s)
                    if got.status_code != 200:
                        err = f"/health answered {got.status_code}"
                except httpx.HTTPError as e:
                    err = f"{type(e).__name__}: {e}"
                if err is not None:
                    self.router.mark_dead(r, err)
                elif not r.alive:
                    logger.info("replica %d (%s) is back", r.index, r.url)
                    r.alive = True
            await asyncio.sleep(interval_s)

    async def follow_events(self, replica: Replica, headers: dict[str, str]) -> None:
        """Keep the router's view of the replica's blocks equal to its pool and tiers: long
        polls of its KV events, from where the view stands (a replica out is followed again,
        from scratch, once it is back)."""
        import httpx
        view = self.router.views[replica.index]
        while True:
            if not replica.alive:
                await asyncio.sleep(0.2)
                continue
            try:
                got = await self.client.get(replica.url + "/v1/kv/events", headers=headers,
                                            params={"since": view.cursor, "timeout_s": EVENT_POLL_S},
                                            timeout=self.probe_timeout.connect + EVENT_POLL_S + 5)
            except httpx.HTTPError:
                await asyncio.sleep(0.2)  # the health check decides whether it is out
                continue
            if got.status_code == 200:
                view.apply(got.json())
            else:  # a replica without events (an older server) is routed to by load
                await asyncio.sleep(EVENT_POLL_S)

    async def get(self, replica: Replica, path: str, headers: Optional[dict[str, str]] = None) -> Any:
        """A replica's answer to GET path, with a short timeout; None, and the replica out, if it fails."""
        import httpx
        try:
            return await self.client.get(replica.url + path, headers=headers, timeout=self.probe_timeout)
        except httpx.HTTPError as e:
            self.router.mark_dead(replica, f"{type(e).__name__}: {e}")
            return None


def _last_event(message: str, code: int) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def _json_object(raw: bytes) -> dict[str, Any]:
    from kvserve.server.app import APIError
    try:
        body = json.loads(raw)
    except ValueError:
        raise APIError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def create_router_app(router: Router, api_key: Optional[str] = None, health_interval_s: float = 1.0,
                      connect_timeout_s: float = 2.0, read_timeout_s: float = 600.0,
                      max_body_bytes: int = ServeOptions.max_body_bytes) -> Any:
    """The router's ASGI app, behind a server's guard: the key (when one is set) on /v1 and
    /router/, the body limit on everything."""
    import httpx
    from fastapi import FastAPI
    from kvserve.server.app import APIError, _Guard, error_response

    front = _Front(router, connect_timeout_s, read_timeout_s)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        front.client = httpx.AsyncClient(timeout=front.timeout, limits=httpx.Limits(max_connections=None))
        health = asyncio.create_task(front.check_health(health_interval_s))
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        feeds = [asyncio.create_task(front.follow_events(r, auth)) for r in router.replicas]
        yield
        health.cancel()
        for feed in feeds:
            feed.cancel()
        await asyncio.gather(*feeds, return_exceptions=True)
        await asyncio.gather(*front.closing, return_exceptions=True)
        await front.client.aclose()

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    app.state.front = front

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> Any:
        return error_response(e)

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=router, keyed=KEYED_PATHS)
    _install_router_routes(app, front)
    return app


def _install_router_routes(app: Any, front: _Front) -> None:
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    from kvserve.server.app import APIError
    router = front.router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await front.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await front.forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for r in router.live():
            if (got := await front.get(r, "/v1/models", auth)) is not None:
                return Response(got.content, status_code=got.status_code, media_type="application/json")
        raise APIError(503, "no replica is available", kind="server_error")

    @app.get("/health")
    async def health() -> Response:
        live = len(router.live())
        return JSONResponse({"status": "ok" if live else "unavailable", "replicas_alive": live,
                             "replicas": len(router.replicas)}, status_code=200 if live else 503)

    @app.get("/router/state")
    async def router_state() -> dict[str, Any]:
        return {"replicas": [{**vars(r), "blocks": router.views[r.index].counts()} for r in router.replicas],
                "cache_routed": router.num_cache_routed,
                "load_routed": router.num_load_routed, "rerouted": router.num_rerouted,
                "rejected": dict(router.num_rejected)}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        texts = {r.index: got.text for r in router.live() if (got := await front.get(r, "/metrics")) is not None}
        return PlainTextResponse(merge_metrics(texts) + router_metrics(router))


def merge_metrics(texts: dict[int, str]) -> str:
    """Each replica's Prometheus text with a replica="i" label on every sample, and a
    replica="total" sample per series: the sum over replicas (the mean for ratios and usage)."""
    out: list[str] = []
    seen_meta: set[str] = set()
    totals: "OrderedDict[tuple[str, str], list[float]]" = OrderedDict()
    for index, text in sorted(texts.items()):
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                if line not in seen_meta:
                    seen_meta.add(line)
                    out.append(line)
                continue
            name_labels, _, value = line.rpartition(" ")
            name, brace, labels = name_labels.partition("{")
            labels = labels.rstrip("}")
            out.append(f'{name}{{{labels + "," if labels else ""}replica="{index}"}} {value}')
            try:
                totals.setdefault((name, labels), []).append(float(value))
            except ValueError:
                pass
    for (name, labels), values in totals.items():
        mean = any(word in name for word in ("usage", "rate", "perc", "fraction"))
        total = sum(values) / len(values) if mean else sum(values)
        out.append(f'{name}{{{labels + "," if labels else ""}replica="total"}} {total:g}')
    return "\n".join(out) + "\n"


def router_metrics(router: Router) -> str:
    lines = ["# HELP kvserve_router_replica_up Whether the router routes to the replica",
             "# TYPE kvserve_router_replica_up gauge"]
    lines += [f'kvserve_router_replica_up{{replica="{r.index}"}} {int(r.alive)}' for r in router.replicas]
    lines += ["# HELP kvserve_router_requests_routed_total Requests sent to each replica",
              "# TYPE kvserve_router_requests_routed_total counter"]
    lines += [f'kvserve_router_requests_routed_total{{replica="{r.index}"}} {r.num_routed}' for r in router.replicas]
    lines += ["# HELP kvserve_router_decisions_total Routing decisions by reason",
              "# TYPE kvserve_router_decisions_total counter",
              f'kvserve_router_decisions_total{{reason="cache"}} {router.num_cache_routed}',
              f'kvserve_router_decisions_total{{reason="load"}} {router.num_load_routed}',
              f'kvserve_router_decisions_total{{reason="reroute"}} {router.num_rerouted}',
              "# HELP kvserve_router_rejected_total Requests refused before routing (401 no key, 413 too large)",
              "# TYPE kvserve_router_rejected_total counter"]
    lines += [f'kvserve_router_rejected_total{{status="{s}"}} {n}' for s, n in sorted(router.num_rejected.items())]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RouterOptions:
    """The router's address and guards; a server's defaults (`kvserve.server.args.ServeOptions`)."""

    host: str = ServeOptions.host
    port: int = ServeOptions.port
    api_key: Optional[str] = None
    max_body_bytes: int = ServeOptions.max_body_bytes
    shutdown_timeout: float = ServeOptions.shutdown_timeout
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)

    def __post_init__(self) -> None:
        check_port(self.port)
        check_at_least("max_body_bytes", self.max_body_bytes, 1)
        check_seconds("shutdown_timeout", self.shutdown_timeout)


def run_router(urls: Sequence[str], options: RouterOptions, on_shutdown: Optional[Callable[[], None]] = None,
               tokenizer: Any = None) -> int:
    """Serve until SIGTERM/SIGINT; then open requests get options.shutdown_timeout to finish and
    are closed (so aborted on their replicas). on_shutdown is called as the shutdown begins
    (`serve -dp` stops its replicas then, so that they wind down within the same grace)."""
    import uvicorn
    from kvserve.server.app import END_STREAMS_BEFORE_S, _GracefulServer  # SIGTERM: a graceful stop, exit 0
    app = create_router_app(Router(list(urls), options.policy, tokenizer), options.api_key,
                            max_body_bytes=options.max_body_bytes)
    logger.info("routing http://%s:%d over %d replicas: %s", options.host, options.port, len(urls), ", ".join(urls))
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level="info",
                            timeout_graceful_shutdown=options.shutdown_timeout)  # type: ignore[arg-type]
    server = _GracefulServer(config)

    def shutting_down() -> None:
        if on_shutdown is not None:
            on_shutdown()
        end_streams_at = max(options.shutdown_timeout - END_STREAMS_BEFORE_S, 0.0)
        asyncio.get_running_loop().call_later(end_streams_at, app.state.front.end_streams)
    server.before_cut = (0.0, shutting_down)
    server.run()
    return 0


def load_tokenizer(model: str, tokenizer: Optional[str] = None) -> Any:
    """The model's tokenizer, for naming requests' blocks as the replicas do (the weights read
    with it are dropped at once)."""
    from kvserve.models.registry import load_weights
    return load_weights(model, tokenizer).tokenizer


def wait_healthy(urls: Sequence[str], timeout_s: float, processes: Sequence[Any] = ()) -> None:
    """Until every replica answers /health (a replica process that exits first is an error)."""
    import httpx
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        for p in processes:
            if p.exitcode is not None:
                raise RuntimeError(f"a replica exited during start-up (code {p.exitcode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas did not start within {timeout_s:.0f} s: {', '.join(pending)}")
        try:
            if httpx.get(pending[0] + "/health", timeout=1).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
