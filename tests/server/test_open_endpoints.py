"""Work a client can ask for without the key cannot take what keyed clients need: with a key set,
/tokenize and /detokenize are behind it as /v1 is; either way they run on their own thread with a
bounded queue (503 past it), never on the worker threads completions tokenize on."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Optional

import httpx

from tests.conftest import STORIES_DIR
from tests.processes import healthy, running
from tests.server.conftest import free_port

KEY = "tenant-key-5"
BIG_TEXT = "Once upon a time there was a cat. " * 30_000  # 1 MB: about 12 s of tokenizing on one core


def serve_command(port: int, *args: str) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "kvserve")
    return [exe, "serve", "--model", str(STORIES_DIR), "--port", str(port), "--shutdown-timeout", "1",
            "--log-stats-interval", "1000", *args]


class Flood:
    """n requests sent at once, each from its own thread; their statuses (None: no answer)."""

    def __init__(self, url: str, n: int, body: dict[str, Any], timeout_s: float) -> None:
        self.statuses: list[Optional[int]] = [None] * n
        self.retry_after: list[Optional[str]] = [None] * n

        def send(i: int) -> None:
            try:
                got = httpx.post(url, json=body, timeout=timeout_s)
                self.statuses[i], self.retry_after[i] = got.status_code, got.headers.get("retry-after")
            except httpx.HTTPError:
                pass
        self.threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _timed(call: Any) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    got = call()
    return time.monotonic() - t0, got


def test_tokenize_without_the_key_cannot_stall_a_keyed_completion():
    """The reported case: 24 requests of 1 MiB without a key took a keyed completion from 0.14 s to 76.7 s."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running(serve_command(port, "--api-key", KEY), ready=healthy(url), timeout_s=120):
        def keyed() -> httpx.Response:
            return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                              json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        alone, got = _timed(keyed)
        assert got.status_code == 200, got.text
        flood = Flood(url + "/tokenize", 24, {"prompt": BIG_TEXT}, timeout_s=60)
        time.sleep(1.0)  # the flood has arrived
        try:
            beside, got = _timed(keyed)
        except httpx.TimeoutException:
            raise AssertionError("a keyed completion beside 24 unkeyed /tokenize took over 30 s") from None
        flood.join(60)
        assert got.status_code == 200
        assert flood.statuses == [401] * 24
        assert beside < alone + 5.0, (alone, beside)
        detok = httpx.post(url + "/detokenize", json={"tokens": [1, 2, 3]}, timeout=30)
        assert detok.status_code == 401


def test_tokenize_is_bounded_without_a_key():
    """With no key, the endpoints stay open but take at most their own thread and a short queue;
    the rest are refused at once with 503 and Retry-After, and the endpoint works afterwards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running(serve_command(port), ready=healthy(url), timeout_s=120):
        flood = Flood(url + "/tokenize", 24, {"prompt": BIG_TEXT[:200_000]}, timeout_s=120)
        flood.join(300)
        refused = [i for i, s in enumerate(flood.statuses) if s == 503]
        assert all(s in (200, 503) for s in flood.statuses), flood.statuses
        assert len(refused) >= 4, flood.statuses  # 1 thread and 8 queued: 15 refused unless arrivals spread
        assert all(flood.retry_after[i] == "1" for i in refused)
        got = httpx.post(url + "/tokenize", json={"prompt": "Once upon"}, timeout=60)
        assert got.status_code == 200 and got.json()["count"] > 1
