"""A client that leaves is noticed whether or not its request has produced anything: a request
still waiting for a seat (or one that makes no progress) is aborted when its client disconnects,
instead of holding its place until its first output shows the disconnect."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import start


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_a_waiting_request_is_aborted_when_its_client_leaves(stories, stream):
    # one seat, taken by an endless request (a window keeps its cache bounded): the second waits
    with start(stories, "s", None, num_blocks=2048, max_num_seqs=1, sliding_window=32) as server:
        sched = lambda: server.app.state.async_engine.stats.scheduler  # noqa: E731
        hog = {"prompt": "Once upon a time", "max_tokens": 30000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions", json=hog) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            waiter = {"prompt": "Tom had a", "max_tokens": 5, "stream": stream}
            with httpx.Client(timeout=1.0) as w:  # the client gives up while the request waits
                try:
                    got = w.post(server.url + "/v1/completions", json=waiter)
                except httpx.TimeoutException:
                    got = None
            assert got is None, (got.status_code, got.text[:500], sched())
            wait_for(lambda: sched().num_waiting == 0, 5.0, "the waiting request was aborted")
            assert sched().num_running == 1  # the hog runs on, untouched
        server.wait_idle()
        assert server.engine.kv.pool.num_used_blocks == 0
