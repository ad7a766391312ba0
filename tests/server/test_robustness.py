"""Bad input gets the right status and a clear message; disconnects free blocks; the server
stays up; the API key is required and never logged; schemathesis finds no 500s."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.conftest import STORIES_DIR
from tests.server.conftest import API_KEY, free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}
KNOWN = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)  # for failure reports


def post(server, path, body, headers=AUTH, raw=None):
    data = raw if raw is not None else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={**headers, "Content-Type": "application/json"},
                      timeout=60)


@pytest.mark.parametrize("body, raw, status, needle", [
    (None, "{not json", 400, "not valid JSON"),
    ({"model": "stories260K", "prompt": 5}, None, 400, "prompt"),
    ({"model": "stories260K", "prompt": "hi", "max_tokens": -1}, None, 400, "max_tokens"),
    ({"model": "stories260K", "prompt": "hi", "max_tokens": "ten"}, None, 400, "max_tokens"),
    ({"model": "stories260K", "prompt": "hi", "temperature": -2}, None, 400, "temperature"),
    ({"model": "stories260K", "prompt": "hi", "top_p": 0}, None, 400, "top_p"),
    ({"model": "stories260K", "prompt": "hi", "n": 1000}, None, 400, "n"),
    ({"model": "stories260K", "prompt": "hi", "stop": [""]}, None, 400, "stop"),
    ({"model": "stories260K", "prompt": "word " * 3000}, None, 400, "context holds"),
    ({"model": "stories260K", "prompt": [1, 99999]}, None, 400, "token ids"),
    ({"model": "stories260K", "prompt": ""}, None, 400, "prompt"),
    ({"model": "gpt-9", "prompt": "hi"}, None, 404, "gpt-9"),
    ({"prompt": "hi"}, None, 200, None),  # model is optional, as in vLLM
])
def test_bad_input_table(stories_server, body, raw, status, needle):
    r = post(stories_server, "/v1/completions", body, raw=raw)
    assert r.status_code == status, r.text
    if needle:
        err = r.json()["error"]
        assert needle in err["message"] and err["type"]
    good = post(stories_server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3})
    assert good.status_code == 200  # the server stays up


def test_chat_without_template_is_400(stories_server):
    r = post(stories_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    r = post(stories_server, "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_api_key_required(stories_server):
    r = post(stories_server, "/v1/completions", {"prompt": "hi"}, headers={})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    r = post(stories_server, "/v1/completions", {"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(stories_server.url + "/health").status_code == 200


def test_oversized_body_is_413(stories_server):
    r = post(stories_server, "/v1/completions", None, raw='{"prompt": "' + "a" * 70000 + '"}')
    assert r.status_code == 413


def test_disconnect_mid_stream_frees_blocks(stories_server):
    engine = stories_server.engine
    body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "temperature": 0, "ignore_eos": True}
    other = httpx.Client(timeout=60)
    with httpx.Client(timeout=60) as c, c.stream("POST", stories_server.url + "/v1/completions",
                                                 json=body, headers=AUTH) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert engine.kv.pool.num_used_blocks > 0
        survivor = other.post(stories_server.url + "/v1/completions", headers=AUTH,
                              json={"prompt": "Tom had", "max_tokens": 10, "temperature": 0})
    stories_server.wait_idle()
    assert engine.kv.pool.num_used_blocks == 0  # its blocks went back to the pool
    assert survivor.status_code == 200 and survivor.json()["usage"]["completion_tokens"] == 10
    other.close()


def test_full_queue_is_503_with_retry_after(stories):
    from tests.server.conftest import start
    with start(stories, "s", None, num_blocks=64, max_waiting=1, max_num_seqs=1) as server:
        import concurrent.futures as cf
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
        with cf.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: post(server, "/v1/completions", body, headers={}), range(8)))
        statuses = [r.status_code for r in codes]
        assert 503 in statuses and 200 in statuses
        r503 = next(r for r in codes if r.status_code == 503)
        assert r503.headers["retry-after"] == "1" and "queue is full" in r503.json()["error"]["message"]


def test_sigterm_finishes_in_flight_and_exits_zero(tmp_path):
    port = free_port()
    env = {**os.environ, "KVSERVE_API_KEY": "s3cret-value"}
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", str(STORIES_DIR),
                             "--port", str(port), "--num-blocks", "64", "--shutdown-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        auth = {"Authorization": "Bearer s3cret-value"}
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", headers=auth, json={
                "prompt": "Once upon a time", "max_tokens": 300, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert "data: [DONE]" in rest  # the in-flight stream was allowed to finish
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert "s3cret-value" not in log


def test_openapi_schema_fuzzing_finds_no_500(stories_server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    schema = schemathesis.openapi.from_url(stories_server.url + "/openapi.json")
    failures, statuses = [], []
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health"):
        for method in ("GET", "POST"):
            try:
                op = schema[path][method]
            except (KeyError, LookupError):
                continue

            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy())
            def check(case):
                if case.body is not None and isinstance(case.body, dict):
                    case.body["max_tokens"] = 4 if not isinstance(case.body.get("max_tokens"), int) \
                        else max(1, min(case.body["max_tokens"], 4))
                r = case.call(base_url=stories_server.url, headers=AUTH, timeout=60)
                statuses.append(r.status_code)
                if r.status_code >= 500:
                    failures.append((path, case.body, r.status_code, r.text[:200]))

            check()
    assert not failures, [(p, {k: v for k, v in b.items() if k in KNOWN} if isinstance(b, dict) else b, s, t)
                          for p, b, s, t in failures[:3]]
    assert len(statuses) >= 40 and 200 in statuses and 400 in statuses  # it really exercised the API
