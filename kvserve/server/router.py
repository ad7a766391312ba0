"""One OpenAI endpoint over several `kvserve serve` replicas, routed by cache affinity.

Each replica's prefix cache only helps the requests that reach it, so a request goes where its
prefix most likely already is (SGLang's cache-aware router): the router remembers, per replica,
the text of the requests it sent there (`PrefixIndex`, an approximate prefix tree) and sends a
request to the replica whose remembered text shares the longest prefix with it, when that covers
at least `cache_threshold` of its text; otherwise, or when the replicas' loads are far apart, to
the least loaded one. Prefixes are remembered per tenant (API key and `cache_salt`), as a
replica's cache keeps them apart: one tenant's traffic never decides where another's goes, so
the routing tells nobody what another tenant sent.

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
from typing import Any, AsyncIterator, Awaitable, Callable, Hashable, Optional, Sequence, TypeVar
from urllib.parse import urlsplit

from fastapi import Request  # the routes' parameter type, resolved from this module's names

from kvserve.config import OptionError, check_at_least, check_seconds
from kvserve.server.args import ServeOptions, check_port

logger = logging.getLogger("kvserve")

CHUNK_CHARS = 16  # the prefix index's resolution
KEYED_PATHS = ("/v1", "/router/")  # what needs the API key when one is set
T = TypeVar("T")


class PrefixIndex:
    """For each replica, the prefixes of the texts routed to it, at CHUNK_CHARS resolution.
    A text's keys are a chain of chunk hashes seeded by its tenant (`keys`), so two texts of one
    tenant share their first k keys exactly when they share their first k chunks, and texts of
    two tenants share none. Least recently used keys are forgotten past max_keys per replica
    (the replica's own cache forgets too)."""

    def __init__(self, max_keys: int = 200_000) -> None:
        self.max_keys = max_keys
        self._keys: dict[int, "OrderedDict[int, None]"] = {}

    @staticmethod
    def keys(text: str, tenant: Hashable = None) -> list[int]:
        """The text's chain of chunk hashes, seeded by a hash of its tenant:

            key[0] = hash((seed, chunk 0)),  key[i] = hash((key[i - 1], chunk i))

        Each character is hashed once, so a text costs time linear in its length (hashing every
        prefix from the start took 7.8 s for 1 MB). A last partial chunk has no key: with
        CHUNK_CHARS = 4, "abcdefghij" has two keys, for "abcd" and then "efgh". Python's hash is
        salted per process (keys never leave it) and 64 bits wide: two different chains meet by
        chance about once in 2**60."""
        key = hash(("kvserve.router", tenant))
        keys = []
        for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
            key = hash((key, text[start:start + CHUNK_CHARS]))
            keys.append(key)
        return keys

    def match(self, replica: int, keys: Sequence[int]) -> int:
        """How many leading keys the replica has seen."""
        held = self._keys.get(replica)
        if held is None:
            return 0
        n = 0
        while n < len(keys) and keys[n] in held:
            n += 1
        return n

    def insert(self, replica: int, keys: Sequence[int]) -> None:
        held = self._keys.setdefault(replica, OrderedDict())
        for k in keys:
            held[k] = None
            held.move_to_end(k)
        while len(held) > self.max_keys:
            held.popitem(last=False)

    def forget(self, replica: int) -> None:
        self._keys.pop(replica, None)


def tenant_of(authorization: str, body: dict[str, Any]) -> tuple[str, Optional[str]]:
    """Who may share a request's prefixes: the same API key (the Authorization header's token;
    its scheme in any case, as the guard takes it) and the same cache_salt."""
    _, _, token = authorization.strip().partition(" ")
    salt = body.get("cache_salt")
    return token.strip(), salt if isinstance(salt, str) else None


@dataclass
class Replica:
    index: int
    url: str
    alive: bool = True
    in_flight: int = 0
    num_routed: int = 0
    num_failed: int = 0
    last_error: Optional[str] = None


@dataclass
class RoutingPolicy:
    cache_threshold: float = 0.5  # the share of a request's text a replica must hold to be chosen for it
    balance_abs_threshold: int = 16  # loads this far apart (in flight) ...
    balance_rel_threshold: float = 2.0  # ... and this many times apart: route by load alone

    def __post_init__(self) -> None:
        if not isinstance(self.cache_threshold, (int, float)) or not 0 <= self.cache_threshold <= 1:
            raise OptionError("cache_threshold", f"must be a share in [0, 1], got {self.cache_threshold!r}")
        check_at_least("balance_abs_threshold", self.balance_abs_threshold, 0)
        # a factor below 1 would call any two loads "this many times apart"
        check_at_least("balance_rel_threshold", self.balance_rel_threshold, 1, integer=False)


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
    """Which replica serves a request (`choose`), and what the router has seen of them."""

    urls: Sequence[str]
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("the router needs at least one replica")
        for url in self.urls:
            check_replica_url(url)
        self.replicas = [Replica(i, u.rstrip("/")) for i, u in enumerate(self.urls)]
        self.index = PrefixIndex()
        self.num_cache_routed = self.num_load_routed = self.num_rerouted = 0
        self.num_rejected: Counter[str] = Counter()  # requests the guard refused, by status

    def live(self, exclude: Sequence[int] = ()) -> list[Replica]:
        return [r for r in self.replicas if r.alive and r.index not in exclude]

    def choose(self, text: str, exclude: Sequence[int] = (), tenant: Hashable = None) -> Optional[Replica]:
        """The replica for a request whose routing text is `text`, from `tenant` (None: none is alive)."""
        live = self.live(exclude)
        if not live:
            return None
        keys = PrefixIndex.keys(text, tenant)
        loads = [r.in_flight for r in live]
        least = min(live, key=lambda r: (r.in_flight, r.num_routed))
        p = self.policy
        imbalanced = max(loads) - min(loads) > p.balance_abs_threshold and max(loads) > p.balance_rel_threshold * min(loads)
        matched = {r.index: self.index.match(r.index, keys) for r in live}
        best = max(live, key=lambda r: (matched[r.index], -r.in_flight))
        if not imbalanced and keys and matched[best.index] * CHUNK_CHARS >= p.cache_threshold * len(text):
            chosen = best
            self.num_cache_routed += 1
        else:
            chosen = least
            self.num_load_routed += 1
        self.index.insert(chosen.index, keys)
        chosen.num_routed += 1
        return chosen

    def mark_dead(self, replica: Replica, error: str) -> None:
        if replica.alive:
            logger.warning("replica %d (%s) is out: %s", replica.index, replica.url, error)
        replica.alive, replica.last_error = False, error
        replica.num_failed += 1
        self.index.forget(replica.index)  # its cache is gone with it

    def reject(self, status: str) -> None:
        """The guard's count of what it refused (a server's metrics take the same call)."""
        self.num_rejected[status] += 1


def routing_text(path: str, body: dict[str, Any]) -> str:
    """What decides where a request goes: the prompt, or the conversation as rendered JSON."""
    if path.endswith("/chat/completions"):
        return json.dumps([[m.get("role"), m.get("content")] for m in body.get("messages") or []
                           if isinstance(m, dict)], ensure_ascii=False)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


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

    def __init__(self, replica: Replica, closing: set[asyncio.Task[None]]) -> None:
        self.replica, self._closing = replica, closing
        self.response: Any = None  # the replica's httpx response, once its headers have come
        self._released = False
        replica.in_flight += 1

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.replica.in_flight -= 1
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
        text = routing_text(path, body)
        tenant = tenant_of(request.headers.get("authorization", ""), body)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        tried: list[int] = []
        while (replica := self.router.choose(text, tried, tenant)) is not None:
            tried.append(replica.index)
            try:
                return await self._via(replica, request, path, raw, headers, bool(body.get("stream")))
            except httpx.HTTPError as e:
                self.router.mark_dead(replica, f"{type(e).__name__}: {e}")
                self.router.num_rerouted += 1
            except ClientGone:
                raise APIError(499, "client disconnected", kind="client_closed_request") from None
        raise APIError(503, "no replica is available to serve this request", kind="server_error")

    async def _via(self, replica: Replica, request: Request, path: str, raw: bytes, headers: dict[str, str],
                   stream: bool) -> Any:
        """The replica's answer (HTTPError: it failed before answering; ClientGone: the client left first)."""
        from fastapi.responses import Response, StreamingResponse
        from starlette.background import BackgroundTask
        upstream = _Upstream(replica, self.closing)
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
        yield
        health.cancel()
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
        return {"replicas": [vars(r) for r in router.replicas], "cache_routed": router.num_cache_routed,
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


def run_router(urls: Sequence[str], options: RouterOptions, on_shutdown: Optional[Callable[[], None]] = None) -> int:
    """Serve until SIGTERM/SIGINT; then open requests get options.shutdown_timeout to finish and
    are closed (so aborted on their replicas). on_shutdown is called as the shutdown begins
    (`serve -dp` stops its replicas then, so that they wind down within the same grace)."""
    import uvicorn
    from kvserve.server.app import END_STREAMS_BEFORE_S, _GracefulServer  # SIGTERM: a graceful stop, exit 0
    app = create_router_app(Router(list(urls), options.policy), options.api_key,
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
