"""The retention extension field on completions and chat (validated with a 400 naming it,
shown per block in /v1/kv/state) and the preemption choices counted in /metrics."""

import re
import threading

import httpx
import pytest

from kvserve.config import FieldError
from kvserve.server.protocol import ChatCompletionRequest

from tests.server.conftest import API_KEY, start

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SYSTEM = "Once upon a time, there was a little girl named Lily. She loved to play outside. "


def post(server, path, body):
    return httpx.post(server.url + path, headers=AUTH, timeout=120, json={"model": "stories260K", **body})


def test_retention_field_is_validated_and_reaches_the_blocks(stories):
    with start(stories, "stories260K", API_KEY, num_blocks=64, block_size=8) as server:
        bad = post(server, "/v1/completions", {"prompt": SYSTEM, "max_tokens": 2,
                                                "kv_retention": [{"start": 0, "end": 16, "priority": 101}]})
        assert bad.status_code == 400
        assert "kv_retention" in bad.text and "priority must be an integer in [1, 100], got 101" in bad.text
        ok = post(server, "/v1/completions", {"prompt": SYSTEM, "max_tokens": 2, "temperature": 0,
                                               "kv_retention": [{"start": 0, "end": 16, "priority": 80,
                                                                 "duration_s": 600}]})
        assert ok.status_code == 200, ok.text
        server.wait_idle()
        state = httpx.get(server.url + "/v1/kv/state", headers=AUTH, timeout=30).json()
        kept = [b for b, p in enumerate(state["blocks"]["retention"]) if p == 80]
        assert len(kept) == 2 and all(state["blocks"]["hashed"][b] == "1" for b in kept)
        assert state["eviction_policy"] == "lru" and state["preemption_mode"] == "auto"
        assert "retention" in httpx.get(server.url + "/dashboard", timeout=30).text


def test_chat_requests_take_the_field_too():
    body = {"messages": [{"role": "user", "content": "hi"}], "kv_retention": [{"start": 0, "end": 8, "priority": 70}]}
    params = ChatCompletionRequest(**body).sampling_params(16, None)
    assert [(r.start, r.end, r.priority, r.duration_s) for r in params.kv_retention] == [(0, 8, 70, None)]
    body["kv_retention"] = [{"start": 0, "priority": 50}]
    with pytest.raises(FieldError, match=re.escape("kv_retention range {'start': 0, 'priority': 50}: missing ['end']")):
        ChatCompletionRequest(**body).sampling_params(16, None)


def test_preemption_choices_are_counted_in_metrics(stories):
    with start(stories, "stories260K", API_KEY, num_blocks=14, block_size=8, max_num_seqs=8,
               swap_space=1 << 22) as server:
        def run(i):
            r = post(server, "/v1/completions", {"prompt": SYSTEM + f"{i} " * (i + 1), "max_tokens": 24,
                                                  "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        server.wait_idle()
        text = httpx.get(server.url + "/metrics", timeout=30).text
        choices = {(m, why): float(v) for m, why, v in re.findall(
            r'^kvserve_preemption_choices_total\{mode="(\w+)",reason="(\w+)"\} ([0-9.e+]+)$', text, re.M)}
        preemptions = float(re.search(r"^kvserve_num_preemptions ([0-9.e+]+)$", text, re.M).group(1))
        assert preemptions > 0 and sum(choices.values()) == preemptions
        assert set(choices) <= {("swap", "swap_cheaper"), ("recompute", "recompute_cheaper"),
                                ("recompute", "no_host_room")}
        speed = float(re.search(r"^kvserve_preemption_prefill_tokens_per_second ([0-9.e+]+)$", text, re.M).group(1))
        assert speed > 0
