"""Requests as real clients send them: chat content as a list of text parts, the developer and
tool roles; completions that echo the prompt with its logprobs (the way evaluation harnesses
score text), score it without generating, or take several prompts; /tokenize and /detokenize;
fields not served yet are refused by name, never ignored."""

import json
import math

import httpx
import openai
import pytest

from kvserve.core.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def chat(server, **body):
    return httpx.post(server.url + "/v1/chat/completions", json={"max_tokens": 8, "temperature": 0, **body},
                      timeout=120)


def test_content_parts_and_developer_role_equal_their_plain_forms(smollm2_server):
    c = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)
    plain = c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi\nto me"}])
    parts = c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Say hi"}, {"type": "text", "text": "to me"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    streamed = c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0, stream=True,
                                         messages=[{"role": "developer", "content": [{"type": "text",
                                                                                      "text": "You are terse."}]},
                                                   {"role": "user", "content": [{"type": "text", "text": "Say hi"},
                                                                                {"type": "text", "text": "to me"}]}])
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == \
        plain.choices[0].message.content


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": ""}}]},
     "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"one": 5}}, "logit_bias"),
])
def test_what_is_not_served_is_refused_by_name(smollm2_server, body, param):
    r = chat(smollm2_server, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_with_logprobs_scores_the_prompt(stories_server, stories):
    prompt = "Once upon a time there was a little girl"
    engine = make_engine(stories)
    engine.add_request("ref", prompt, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2))
    ref = None
    while engine.has_unfinished():
        for out in engine.step():
            ref = out
    ids = ref.prompt_token_ids
    for max_tokens in (0, 4):
        r = httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=60, json={
            "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt) and len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert math.isclose(lp["token_logprobs"][i], ref.prompt_logprobs[i][ids[i]], abs_tol=1e-4)
            assert len(lp["top_logprobs"][i]) >= 2
        offsets = lp["text_offset"]
        assert offsets == sorted(offsets) and offsets[-1] < len(choice["text"])
        if max_tokens:
            assert offsets[len(ids)] == len(prompt)  # the output's text starts after the prompt's


def test_several_prompts_in_one_request(stories_server):
    r = httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": ["Once upon a time", "Lily and Tom"], "max_tokens": 4, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"] and choices[2]["text"] == choices[3]["text"]
    single = httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).json()
    assert choices[0]["text"] == single["choices"][0]["text"]
    assert r.json()["usage"]["completion_tokens"] == 16
    ids = httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": [[1, 403, 407], [1, 403]], "max_tokens": 2, "temperature": 0})
    assert ids.status_code == 200 and len(ids.json()["choices"]) == 2
    mixed = httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": ["Once", [1, 403]], "max_tokens": 2})
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "prompt"



def test_several_prompts_streamed(stories_server):
    """A stream of several prompts interleaves their chunks; put back together by index, each
    choice is what the request without streaming gives, and usage sums every prompt."""
    body = {"prompt": ["Once upon a time", "Lily and Tom", "The sun"], "max_tokens": 12, "temperature": 0, "n": 2,
            "logprobs": 1}
    whole = httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=60, json=body).json()
    texts, reasons, tokens = {}, {}, {}
    with httpx.stream("POST", stories_server.url + "/v1/completions", headers=AUTH, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in map(json.loads, events[:-2]):
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            tokens[c["index"]] = tokens.get(c["index"], []) + c["logprobs"]["tokens"]
            reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
    assert sorted(texts) == list(range(6))
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"] and reasons[c["index"]] == c["finish_reason"]
        assert tokens[c["index"]] == c["logprobs"]["tokens"]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 72


def test_max_tokens_zero_needs_echo(stories_server):
    r = httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Once", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_tokenize_and_detokenize(stories_server):
    r = httpx.post(stories_server.url + "/tokenize", json={"prompt": "Once upon"}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 1
    back = httpx.post(stories_server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, headers=AUTH,
                      timeout=30)
    assert back.status_code == 200 and back.json()["prompt"] == "Once upon"
    bad = httpx.post(stories_server.url + "/detokenize", json={"tokens": [10 ** 6]}, headers=AUTH, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_json_schema_output_validates_streamed_and_not(smollm2_server):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    c = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=60, temperature=0.7, seed=3,
              messages=[{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}],
              response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema,
                                                                      "strict": True}})
    whole = c.chat.completions.create(**kw)
    jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw)
                       if ch.choices)
    assert streamed == whole.choices[0].message.content
    r = httpx.post(smollm2_server.url + "/v1/completions", timeout=120, json={
        "prompt": "The answer is", "max_tokens": 5, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
