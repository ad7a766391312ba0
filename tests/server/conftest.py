"""A real server on a free loopback port, in a background thread, over a real engine."""

from __future__ import annotations

import collections
import logging
import threading
import time
import warnings
from typing import Any, Iterator

import httpx
import pytest

from kvserve.distributed.workers import free_port  # noqa: F401 - the tests' free loopback port
from tests.conftest import make_engine

API_KEY = "test-key-123"


class LogTail(logging.Handler):
    """The last lines uvicorn and kvserve logged while attached (uvicorn's own loggers do not
    propagate to the root, so pytest's log capture misses them)."""

    LOGGERS = ("uvicorn", "kvserve")

    def __init__(self, num_lines: int = 40) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=num_lines)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def attach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)

    def detach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)

    def text(self) -> str:
        return "\n".join(self.lines) or "(nothing)"


class RunningServer:
    """uvicorn serving `app` in a daemon thread. A server that fails to start says why: its thread's
    error and the last lines uvicorn and kvserve logged. Leaving asks it to exit, then forces it."""

    def __init__(self, app: Any, engine: Any) -> None:
        import uvicorn
        self.app, self.engine = app, engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.error: BaseException | None = None
        self.log = LogTail()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as e:  # uvicorn exits with SystemExit when it cannot bind
            self.error = e
            raise

    def __enter__(self) -> "RunningServer":
        self.log.attach()
        self.thread.start()
        try:
            self._wait_started(30)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on port {self.port} stopped during start-up "
                                   f"({self.error!r}); its log ends:\n{self.log.text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.port} did not start within {timeout_s:.0f} s; "
                                   f"its log ends:\n{self.log.text()}")
            time.sleep(0.05)

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        if self.thread.is_alive():  # requests still open past the grace: close them
            self.server.force_exit = True
            self.thread.join(10)
        self.log.detach()
        if self.thread.is_alive():
            warnings.warn(f"the server thread on port {self.port} did not stop", RuntimeWarning)

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
    # the exact path: these tests hold the API to the model's answers, which the defaults may tip at
    # a near-tie (docs/defaults.md); tests/engine/test_defaults.py holds the defaults
    with start(smollm2, "SmolLM2-135M-Instruct", None, num_blocks=256, max_model_len=2048, exact=True) as s:
        yield s
