"""The router is as guarded as a single server: its body limit holds for chunked bodies, it takes
the API key as the server does (any case of "Bearer") and keeps /router/state behind it, a prefix
lookup costs time linear in the prompt, routing by prefix never crosses tenants (cache_salt), a
client that leaves (streamed or not) ends its replica's work, and `serve -dp` exits within
--shutdown-timeout with a request running and a body still arriving."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Iterator

import httpx
import pytest

from kvserve.server.router import Router, create_router_app, load_tokenizer
from tests.processes import healthy, running, wait_ready
from tests.server.conftest import RunningServer, free_port
from tests.conftest import STORIES_DIR
from tests.server.test_router import FAMILIES, FAMILY_IDS, names, ready, serve_command

KEY = "router-key-7"
LONG = {"prompt": [f"Once upon a time {i}" for i in range(32)], "max_tokens": 480, "ignore_eos": True,
        "temperature": 0}  # with --max-num-seqs 1, 32 * 480 steps: minutes of work
WIDE = {"prompt": [f"Once upon a time {i}" for i in range(64)], "max_tokens": 500, "ignore_eos": True,
        "temperature": 0}  # 64 sequences side by side for 500 steps: seconds at least


# ---- the policy ----
def test_naming_a_long_request_is_linear_in_its_tokens():
    router = ready(Router(["http://a", "http://b"]), block_size=16)
    tokens = list(range(200_000)) * 5  # a million tokens: one hash per block, never per prefix
    t0 = time.monotonic()
    first = router.choose(router.block_names(tokens, None))
    again = router.choose(router.block_names(tokens + [7, 8, 9], None))
    assert time.monotonic() - t0 < 5.0
    assert again.index == first.index and router.num_cache_routed == 1


def test_routing_by_prefix_never_crosses_tenants():
    """A guess at another tenant's prompt (another cache_salt) is routed as a wrong guess is: the
    names of its blocks differ from the first block on; a tenant's own prefix still routes by cache."""
    router = ready(Router(["http://a", "http://b"]))
    for f in range(3):
        router.choose(names(router, f, 0, salt="victim"))
    decisions = []
    for f in range(3):
        right = names(router, f, 1, salt="attacker")
        wrong = router.block_names(FAMILY_IDS[f][::-1] + [9, 9, 9], "attacker")
        for guess in (right, wrong):
            before = router.num_cache_routed
            router.choose(guess)
            decisions.append(router.num_cache_routed - before)
    assert decisions == [0] * len(decisions)
    before = router.num_cache_routed
    router.choose(names(router, 0, 1, salt="victim"))
    assert router.num_cache_routed == before + 1


def test_the_tenant_is_the_cache_salt():
    from kvserve.server.router import cache_salt_of
    assert cache_salt_of({"cache_salt": "s"}) == "s"
    assert cache_salt_of({}) is None and cache_salt_of({"cache_salt": 3}) is None


# ---- through HTTP, over real replicas ----
@pytest.fixture(scope="module")
def replica_urls() -> Iterator[list[str]]:
    ports = [free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(running(serve_command(p, "--num-blocks", "2048", "--shutdown-timeout", "1")))
                   for p in ports]
        wait_ready([(s, healthy(u)) for s, u in zip(servers, urls)], 180)
        yield urls


@contextlib.contextmanager
def front(urls: list[str], **options: Any) -> Iterator[tuple[Router, RunningServer]]:
    """A router over the replicas, in a thread; every test's own, so no counter is shared."""
    router = Router(urls, tokenizer=load_tokenizer(str(STORIES_DIR)))
    with RunningServer(create_router_app(router, health_interval_s=0.2, **options), None) as server:
        yield router, server


def test_the_body_limit_holds_for_chunked_bodies(replica_urls):
    limit = 1 << 20  # the server's default
    too_big = b'{"prompt": "' + b"a" * (limit + 1000)
    with front(replica_urls) as (_, server):
        sized = httpx.post(server.url + "/v1/completions", content=too_big, timeout=30,
                           headers={"content-type": "application/json"})
        assert sized.status_code == 413, sized.text

        def chunks() -> Iterator[bytes]:
            for start in range(0, len(too_big), 65536):
                yield too_big[start:start + 65536]
        chunked = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30,
                             headers={"content-type": "application/json"})
        assert chunked.status_code == 413, chunked.text
        assert "larger than" in chunked.json()["error"]["message"]
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_the_key_is_taken_as_a_server_takes_it_and_guards_the_state(replica_urls):
    body = {"prompt": FAMILIES[0], "max_tokens": 2, "temperature": 0}
    with front(replica_urls, api_key=KEY) as (_, server):
        for scheme in ("Bearer", "bearer", "BEARER"):
            got = httpx.post(server.url + "/v1/completions", json=body, timeout=60,
                             headers={"Authorization": f"{scheme} {KEY}"})
            assert got.status_code == 200, (scheme, got.text)
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            assert httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=30).status_code == 401
            assert httpx.get(server.url + "/router/state", headers=auth, timeout=30).status_code == 401
        state = httpx.get(server.url + "/router/state", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert state.status_code == 200 and len(state.json()["replicas"]) == 2
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # open, as a server's


def test_an_attacker_cannot_tell_a_tenants_prompt_from_the_routing(replica_urls):
    """The reported attack: another tenant (another cache_salt) sends right and wrong guesses at a
    victim's prompts and reads the cache-routed counter after each."""
    with front(replica_urls) as (_, server):
        def cache_routed() -> int:
            return int(httpx.get(server.url + "/router/state", timeout=30).json()["cache_routed"])

        def send(prompt: str, salt: str) -> int:
            """How many cache-routed decisions the request added."""
            before = cache_routed()
            got = httpx.post(server.url + "/v1/completions", timeout=60,
                             json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": salt})
            assert got.status_code == 200, got.text
            return cache_routed() - before

        for f in FAMILIES:
            send(f, "victim")
        told = [send(guess, "attacker") for f in FAMILIES for guess in (f + " Then", f[::-1] + " Then")]
        assert told == [0] * len(told)
        assert send(FAMILIES[0] + " Then", "victim") == 1  # the victim's own prefix still routes by cache


# ---- a client that leaves; shutdown ----
def _open_request(url: str, body: Any, path: str = "/v1/completions") -> socket.socket:
    """A request sent on a raw connection, left open (closing it is the client leaving)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(head + data)
    return sock


def _num_requests(urls: list[str]) -> int:
    """Requests running or waiting on the replicas."""
    total = 0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        total += sum(int(float(v)) for v in re.findall(r"^kvserve_num_requests_(?:running|waiting) (\S+)$",
                                                       text, re.M))
    return total


def _wait_requests(urls: list[str], done: Any, timeout_s: float) -> None:
    t0 = time.monotonic()
    while not done(_num_requests(urls)):
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"replicas still hold {_num_requests(urls)} request(s) after {timeout_s:.0f} s")
        time.sleep(0.1)


def _num_finished(urls: list[str]) -> int:
    """Requests the replicas ran to their end (an aborted one is not counted)."""
    texts = [httpx.get(url + "/metrics", timeout=10).text for url in urls]
    return sum(int(float(v)) for t in texts for v in re.findall(r'^kvserve_requests_total{status="length"} (\S+)$',
                                                                 t, re.M))


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_a_client_that_leaves_ends_its_replicas_work(replica_urls, stream):
    """The reported case: 3,993 of 4,000 tokens were made for a non-streamed client that had left."""
    _wait_requests(replica_urls, lambda n: n == 0, 120)  # a previous test's work is gone
    num_finished = _num_finished(replica_urls)
    body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": stream}
    with front(replica_urls) as (_, server):
        with contextlib.closing(_open_request(server.url, body)) as sock:
            _wait_requests(replica_urls, lambda n: n > 0, 60)
            if stream:
                assert sock.recv(64).startswith(b"HTTP/1.1 200")  # the stream has begun
        _wait_requests(replica_urls, lambda n: n == 0, 30)
    assert _num_finished(replica_urls) == num_finished  # aborted before its 500th token


def test_serve_dp_exits_within_its_shutdown_grace():
    """SIGTERM with a request running and a chunked body that never ends: exit within the grace
    (it took 52 s with --shutdown-timeout 3; a body left it alive past SIGTERM)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    grace = 2.0
    command = serve_command(port, "-dp", "2", "--num-blocks", "256", "--max-num-seqs", "1",
                            "--shutdown-timeout", str(grace))
    with running(command, ready=healthy(url), timeout_s=180) as server, contextlib.ExitStack() as open_requests:
        work = open_requests.enter_context(contextlib.closing(_open_request(url, LONG)))
        drip = open_requests.enter_context(contextlib.closing(socket.create_connection(("127.0.0.1", port))))
        drip.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")
        time.sleep(2)  # both reached the router; the work is running on a replica
        assert work.fileno() >= 0
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(grace + 6)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {grace + 6:.0f} s after SIGTERM with --shutdown-timeout {grace}")
        assert code == 0 and time.monotonic() - t0 < grace + 6


def test_the_router_ends_its_streams_and_exits_within_its_grace(replica_urls):
    """`kvserve router --shutdown-timeout`: an open stream gets an error event and [DONE] before
    the grace ends, its replica's request is aborted, and the router exits within the grace."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    grace = 2.0
    exe = os.path.join(os.path.dirname(sys.executable), "kvserve")
    command = [exe, "router", "--replica", replica_urls[0], "--port", str(port), "--shutdown-timeout", str(grace)]
    with running(command, ready=healthy(url), timeout_s=60) as router:
        with httpx.stream("POST", url + "/v1/completions", json={**WIDE, "stream": True}, timeout=60) as got:
            lines = got.iter_lines()
            assert next(lines).startswith("data: ")  # the stream has begun
            t0 = time.monotonic()
            router.proc.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
        ended_after = time.monotonic() - t0
        try:
            code = router.proc.wait(grace + 6)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the router was still running {grace + 6:.0f} s after SIGTERM with --shutdown-timeout {grace}")
    assert events[-1] == "data: [DONE]" and "shutting down" in events[-2], events[-3:]
    assert ended_after < grace + 1 and code == 0
    _wait_requests(replica_urls[:1], lambda n: n == 0, 30)  # the replica's 64 sequences were aborted
