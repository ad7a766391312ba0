"""Through the server, one request cannot hurt another: a failing request gets its error (a 500
envelope, or in a stream an error event after a final chunk with finish_reason "error") while
concurrent clients get what they would alone; a client that leaves a non-streamed request stops
it; a chunked body is held to the size limit; text that cannot be tokenized is a 400."""

import json
import threading
import time

import httpx

from kvserve.core.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.server.conftest import start

VICTIM = "Once upon a time there was a dragon"


def _victim_hook(engine):
    victim_ids = engine.tokenizer.encode(VICTIM)

    def hook(stage, seqs):
        if stage == "sample" and any(list(s.prompt_token_ids) == victim_ids for s in seqs):
            raise RuntimeError("injected fault")
    return hook


def test_a_failing_request_fails_alone_under_concurrent_clients(stories):
    prompts = [f"Once upon a time {w}" for w in ("Lily", "Tom", "a cat", "the sun", "a dog", "Ben")]
    offline = make_engine(stories)
    expected = {}
    for p in prompts:
        offline.add_request(p, p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while offline.has_unfinished():
        for out in offline.step():
            if out.finished:
                expected[out.request_id] = out.outputs[0].text
    with start(stories, "stories260K", None, max_num_seqs=16) as server:
        server.engine.runner.fault_hook = _victim_hook(server.engine)
        results, errors = {}, []

        def call(prompt, stream):
            body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": stream}
            try:
                if not stream:
                    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
                    results[(prompt, stream)] = (r.status_code, r.json())
                else:
                    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                    results[(prompt, stream)] = (r.status_code, events)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=call, args=(p, s)) for p in prompts + [VICTIM] for s in (False, True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        status, body = results[(VICTIM, False)]
        assert status == 500 and "injected fault" in body["error"]["message"]
        status, events = results[(VICTIM, True)]
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert any(c.get("choices") and c["choices"][0]["finish_reason"] == "error" for c in chunks)
        assert "injected fault" in chunks[-1]["error"]["message"]
        for p in prompts:
            status, body = results[(p, False)]
            assert status == 200 and body["choices"][0]["text"] == expected[p]
            status, events = results[(p, True)]
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
            assert status == 200 and text == expected[p]
        server.wait_idle()
        assert server.engine.kv.pool.num_free_blocks == server.engine.kv.pool.num_blocks


def test_a_client_leaving_a_non_streamed_request_stops_it(stories):
    with start(stories, "stories260K", None) as server:
        server.engine.runner.fault_hook = lambda stage, seqs: time.sleep(0.02) if stage == "forward" else None
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        t0 = time.monotonic()
        try:
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
        except httpx.TimeoutException:
            pass
        server.wait_idle(timeout=3.0)  # 400 steps of 20 ms would take 8 s
        assert time.monotonic() - t0 < 5.0
        assert server.engine.num_generated_tokens < 200


def test_a_chunked_body_is_held_to_the_limit(stories):
    with start(stories, "stories260K", None) as server:  # 64 KiB limit
        def chunks():
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"a" * 4096
            yield b'", "max_tokens": 1}'
        r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body larger")
        assert httpx.get(server.url + "/health").status_code == 200


def test_text_that_cannot_be_tokenized_is_a_400(smollm2_server):
    for path, body in (("/v1/completions", '{"prompt": "a \\ud800 b", "max_tokens": 1}'),
                       ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], '
                                                '"max_tokens": 1}')):
        r = httpx.post(smollm2_server.url + path, content=body, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"] in ("prompt", "messages")


def test_temperatures_that_underflow_hurt_nobody(stories):
    """temperature 1e-300 is 0 in float32: greedy, for it and for everyone beside it."""
    with start(stories, "stories260K", None) as server:
        bodies = [{"prompt": "x", "max_tokens": 1, "temperature": 1e-300, **extra}
                  for extra in ({}, {"n": 2}, {"top_k": 1}, {"min_p": 0.5})]
        bodies += [{"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}] * 4
        results = []
        threads = [threading.Thread(target=lambda b=b: results.append(
            httpx.post(server.url + "/v1/completions", json=b, timeout=60).status_code)) for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [200] * len(bodies)
