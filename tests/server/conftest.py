"""A real server on a free loopback port, in a background thread, over a real engine."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from kvserve.distributed.workers import free_port  # noqa: F401 - the tests' free loopback port
from tests.conftest import make_engine

API_KEY = "test-key-123"


class RunningServer:
    def __init__(self, app: Any, engine: Any) -> None:
        import uvicorn
        self.app, self.engine = app, engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine has no request left (aborts are applied on the engine thread)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.app.state.async_engine.stats.scheduler
            if not self.engine.has_unfinished() and s.num_running == 0 and s.num_waiting == 0:
                return
            time.sleep(0.02)
        raise AssertionError("engine still busy")


def start(loaded: Any, name: str, api_key: Any = None, **options: Any) -> RunningServer:
    from kvserve.server.app import create_app
    engine = make_engine(loaded, **options)
    return RunningServer(create_app(engine, name, api_key, max_body_bytes=1 << 16), engine)


@pytest.fixture(scope="module")
def stories_server(stories) -> Iterator[RunningServer]:
    with start(stories, "stories260K", API_KEY, num_blocks=512, max_waiting=256, max_num_seqs=32) as s:
        yield s


@pytest.fixture(scope="module")
def smollm2_server(smollm2) -> Iterator[RunningServer]:
    with start(smollm2, "SmolLM2-135M-Instruct", None, num_blocks=256, max_model_len=2048) as s:
        yield s
