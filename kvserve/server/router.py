"""One OpenAI endpoint over several `kvserve serve` replicas, routed by cache affinity.

Each replica's prefix cache only helps the requests that reach it, so a request goes where its
prefix most likely already is (SGLang's cache-aware router): the router remembers, per replica,
the text of the requests it sent there (`PrefixIndex`, an approximate prefix tree) and sends a
request to the replica whose remembered text shares the longest prefix with it, when that covers
at least `cache_threshold` of its text; otherwise, or when the replicas' loads are far apart, to
the least loaded one.

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
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import Request  # the routes' parameter type, resolved from this module's names

logger = logging.getLogger("kvserve")

CHUNK_CHARS = 16  # the prefix index's resolution


class PrefixIndex:
    """For each replica, the prefixes of the texts routed to it, at CHUNK_CHARS resolution: a
    text's i-th key is the hash of its first (i + 1) * CHUNK_CHARS characters, so two texts share
    their first k keys exactly when they share their first k chunks. Least recently used keys are
    forgotten past max_keys per replica (the replica's own cache forgets too)."""

    def __init__(self, max_keys: int = 200_000) -> None:
        self.max_keys = max_keys
        self._keys: dict[int, "OrderedDict[int, None]"] = {}

    @staticmethod
    def keys(text: str) -> list[int]:
        return [hash(text[:end]) for end in range(CHUNK_CHARS, len(text) + 1, CHUNK_CHARS)]

    def match(self, replica: int, keys: Sequence[int]) -> int:
        """How many leading keys the replica has seen."""
        held = self._keys.get(replica, {})
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


@dataclass
class Router:
    """Which replica serves a request (`choose`), and what the router has seen of them."""

    urls: Sequence[str]
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("the router needs at least one replica")
        self.replicas = [Replica(i, u.rstrip("/")) for i, u in enumerate(self.urls)]
        self.index = PrefixIndex()
        self.num_cache_routed = self.num_load_routed = self.num_rerouted = 0

    def live(self, exclude: Sequence[int] = ()) -> list[Replica]:
        return [r for r in self.replicas if r.alive and r.index not in exclude]

    def choose(self, text: str, exclude: Sequence[int] = ()) -> Optional[Replica]:
        """The replica for a request whose routing text is `text` (None: none is alive)."""
        live = self.live(exclude)
        if not live:
            return None
        keys = PrefixIndex.keys(text)
        loads = [r.in_flight for r in live]
        least = min(live, key=lambda r: (r.in_flight, r.num_routed))
        p = self.policy
        imbalanced = max(loads) - min(loads) > p.balance_abs_threshold and max(loads) > p.balance_rel_threshold * min(loads)
        best = max(live, key=lambda r: (self.index.match(r.index, keys), -r.in_flight))
        matched = self.index.match(best.index, keys) * CHUNK_CHARS
        if not imbalanced and keys and matched >= p.cache_threshold * len(text):
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


def routing_text(path: str, body: dict[str, Any]) -> str:
    """What decides where a request goes: the prompt, or the conversation as rendered JSON."""
    if path.endswith("/chat/completions"):
        return json.dumps([[m.get("role"), m.get("content")] for m in body.get("messages") or []
                           if isinstance(m, dict)], ensure_ascii=False)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


# ---- the HTTP front ----
def create_router_app(router: Router, api_key: Optional[str] = None, health_interval_s: float = 1.0,
                      connect_timeout_s: float = 2.0, read_timeout_s: float = 600.0) -> Any:
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
    state: dict[str, Any] = {}

    async def check_health() -> None:
        while True:
            for r in router.replicas:
                err: Optional[str] = None
                try:
                    got = await state["client"].get(r.url + "/health", timeout=connect_timeout_s)
                    if got.status_code != 200:
                        err = f"/health answered {got.status_code}"
                except httpx.HTTPError as e:
                    err = f"{type(e).__name__}: {e}"
                if err is not None:
                    router.mark_dead(r, err)
                elif not r.alive:
                    logger.info("replica %d (%s) is back", r.index, r.url)
                    r.alive = True
            await asyncio.sleep(health_interval_s)

    async def lifespan(app: Any) -> AsyncIterator[None]:
        state["client"] = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
        task = asyncio.create_task(check_health())
        yield
        task.cancel()
        await state["client"].aclose()

    app = FastAPI(title="kvserve router", lifespan=lifespan)

    def error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    def authorized(request: Request) -> bool:
        return api_key is None or request.headers.get("authorization") == f"Bearer {api_key}"

    async def forward(request: Request, path: str) -> Response:
        if not authorized(request):
            return error(401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error")
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", "invalid_request_error")
        text = routing_text(path, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        tried: list[int] = []
        while (replica := router.choose(text, tried)) is not None:
            tried.append(replica.index)
            replica.in_flight += 1
            try:
                upstream = await state["client"].send(
                    state["client"].build_request("POST", replica.url + path, content=raw, headers=headers), stream=True)
            except httpx.HTTPError as e:
                replica.in_flight -= 1
                router.mark_dead(replica, f"{type(e).__name__}: {e}")
                router.num_rerouted += 1
                continue
            if body.get("stream") and upstream.status_code == 200:
                return StreamingResponse(relay(upstream, replica), media_type="text/event-stream",
                                         headers={"x-kvserve-replica": str(replica.index)})
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                router.mark_dead(replica, f"{type(e).__name__}: {e}")
                router.num_rerouted += 1
                continue
            finally:
                replica.in_flight -= 1
                await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type"),
                            headers={"x-kvserve-replica": str(replica.index)})
        return error(503, "no replica is available to serve this request")

    async def relay(upstream: Any, replica: Replica) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            router.mark_dead(replica, f"{type(e).__name__}: {e}")
            message = {"error": {"message": f"replica {replica.index} failed mid-stream: {type(e).__name__}",
                                 "type": "server_error", "code": 502}}
            yield f"data: {json.dumps(message)}\n\ndata: [DONE]\n\n".encode()
        finally:
            replica.in_flight -= 1
            await upstream.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for r in router.live():
            try:
                got = await state["client"].get(r.url + "/v1/models", headers=dict(request.headers))
                return Response(got.content, status_code=got.status_code, media_type="application/json")
            except httpx.HTTPError as e:
                router.mark_dead(r, f"{type(e).__name__}: {e}")
        return error(503, "no replica is available")

    @app.get("/health")
    async def health() -> Response:
        live = len(router.live())
        return JSONResponse({"status": "ok" if live else "unavailable", "replicas_alive": live,
                             "replicas": len(router.replicas)}, status_code=200 if live else 503)

    @app.get("/router/state")
    async def router_state() -> dict[str, Any]:
        return {"replicas": [vars(r) for r in router.replicas], "cache_routed": router.num_cache_routed,
                "load_routed": router.num_load_routed, "rerouted": router.num_rerouted}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        texts = {}
        for r in router.live():
            try:
                texts[r.index] = (await state["client"].get(r.url + "/metrics")).text
            except httpx.HTTPError as e:
                router.mark_dead(r, f"{type(e).__name__}: {e}")
        return PlainTextResponse(merge_metrics(texts) + router_metrics(router))

    return app


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
              f'kvserve_router_decisions_total{{reason="reroute"}} {router.num_rerouted}']
    return "\n".join(lines) + "\n"


def run_router(urls: Sequence[str], host: str, port: int, api_key: Optional[str], policy: RoutingPolicy) -> int:
    import uvicorn
    from kvserve.server.app import _GracefulServer  # SIGTERM: a graceful stop, exit 0
    app = create_router_app(Router(list(urls), policy), api_key)
    logger.info("routing http://%s:%d over %d replicas: %s", host, port, len(urls), ", ".join(urls))
    _GracefulServer(uvicorn.Config(app, host=host, port=port, log_level="info")).run()
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
