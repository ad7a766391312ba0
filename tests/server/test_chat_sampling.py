"""Chat on SmolLM2: exactly k top_logprobs with bytes, streamed and not; logit_bias; tool calls
that survive the token budget; streams without empty deltas; continuous usage stats."""

import json

import httpx
import openai
import pytest

from kvserve.server.tools import RequiredParser

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0)


def stream_chunks(server, messages=ASK, **body):
    """Every chunk of a streamed chat completion, as dicts."""
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"messages": messages, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("k", [1, 3])
def test_exactly_k_top_logprobs_with_bytes(client, k):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=k)
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == k
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in entry.top_logprobs)
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=k, stream=True)
    rows = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in rows] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in content]


def test_sampled_tokens_outside_the_top_k_are_not_added(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=1.5, seed=3,
                                       logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    assert all(len(e.top_logprobs) == 1 for e in content)
    assert any(e.top_logprobs[0].token != e.token for e in content)  # at 1.5 some token is not the favourite


def test_logit_bias_on_chat(client, smollm2_server):
    tok = smollm2_server.engine.tokenizer
    target = tok.encode(" banana", add_special_tokens=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                       logit_bias={str(target): 100})
    assert r.choices[0].message.content == tok.decode([target] * 3)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    banned_id = tok.encode(first, add_special_tokens=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0, logprobs=True,
                                       logit_bias={str(banned_id): -100})
    assert r.choices[0].logprobs.content[0].token != first


def test_required_calls_survive_the_budget(client):
    ask = [{"role": "user", "content": "What is the weather in Paris and in London?"}]
    full = client.chat.completions.create(model=MODEL, messages=ask, tools=WEATHER, tool_choice="required",
                                          max_tokens=60, temperature=0, logprobs=True)
    calls = full.choices[0].message.tool_calls
    assert len(calls) >= 2, full  # the model makes several calls, so a budget can cut a later one
    budget = first_call_length([e.token for e in full.choices[0].logprobs.content]) + 3
    cut = client.chat.completions.create(model=MODEL, messages=ask, tools=WEATHER, tool_choice="required",
                                         max_tokens=budget, temperature=0)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [c.function.arguments for c in choice.message.tool_calls] == [calls[0].function.arguments]


def first_call_length(tokens):
    """How many tokens the forced output takes up to the end of its first call."""
    parser = RequiredParser()
    for i, t in enumerate(tokens):
        if parser.feed(t).calls:
            return i + 1
    raise AssertionError("no complete call")


def test_a_bias_cannot_push_past_a_structured_mask(client, smollm2_server):
    tok = smollm2_server.engine.tokenizer

    def pet(bias=None):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a pet."}],
                                           max_tokens=6, temperature=0, logit_bias=bias, logprobs=True,
                                           extra_body={"guided_choice": ["cat", "dog"]})
        return r.choices[0].message.content, r.choices[0].logprobs.content[0].token
    base, first = pet()
    assert base in ("cat", "dog")
    (first_id,) = tok.encode(first, add_special_tokens=False)
    assert pet({str(first_id): -100})[0] == ({"cat", "dog"} - {base}).pop()  # the favourite ruled out
    outside = tok.encode(" zebra", add_special_tokens=False)[0]
    assert pet({str(outside): 100})[0] in ("cat", "dog")  # the mask has the last word


def test_streamed_tool_calls_send_no_empty_deltas(smollm2_server):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        chunks = stream_chunks(smollm2_server, [{"role": "user", "content": "What is the weather in Paris?"}],
                               tools=WEATHER, tool_choice=choice, max_tokens=60, temperature=0,
                               logprobs=True, stream_options={"include_usage": True})
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        assert all(d["delta"] or d["finish_reason"] for d in deltas), choice
        if choice == "required":  # calls go out whole: the tokens held back meanwhile sent nothing
            assert len(deltas) < chunks[-1]["usage"]["completion_tokens"]
        calls = [tc for d in deltas for tc in d["delta"].get("tool_calls", [])]
        assert calls, choice
        # the logprobs of held-back text are not lost: one entry per generated token
        tokens = sum(len(d["logprobs"]["content"]) for d in deltas if d["logprobs"])
        assert tokens == chunks[-1]["usage"]["completion_tokens"] > 0


def test_continuous_usage_stats(smollm2_server):
    chunks = stream_chunks(smollm2_server, max_tokens=10, temperature=0, ignore_eos=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 10 and counts[0] < 10
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == \
        chunks[-1]["usage"]["prompt_tokens"] + 10
    without = stream_chunks(smollm2_server, max_tokens=4, temperature=0, stream_options={"include_usage": True})
    assert all("usage" not in c for c in without[:-1])


def test_a_hermes_stream_holds_back_without_empty_deltas(smollm2_server):
    """auto (this small model does not call tools by itself): the formatter over scripted outputs,
    a call split across pieces; what is held back sends nothing, its logprobs go with the next."""
    from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from kvserve.server.app import _Formatter
    from kvserve.server.tools import plan_tools
    tok = smollm2_server.engine.tokenizer
    plan = plan_tools(WEATHER, "auto", None, tok.chat_template, "hermes")
    fmt = _Formatter("id", MODEL, True, tok, tools=plan, num_top=1)
    pieces = ["Sure. ", "<tool", "_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]
    ids, chunks = [], []
    for i, piece in enumerate(pieces):
        new = tok.encode(piece, add_special_tokens=False)
        ids += new
        done = i == len(pieces) - 1
        out = CompletionOutput(0, "", list(ids), "stop" if done else None, logprobs=[{t: -1.0} for t in ids],
                               delta=piece, delta_token_ids=new)
        chunks += fmt.delta_choices(RequestOutput("id", None, [1], [out], done, RequestMetrics(0.0)))
    assert all(c["delta"] or c["finish_reason"] for c in chunks)
    assert chunks[0]["delta"] == {"content": "Sure. "} and len(chunks) == 2
    assert chunks[-1]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert sum(len(c["logprobs"]["content"]) for c in chunks) == len(ids)
