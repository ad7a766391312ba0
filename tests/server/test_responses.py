"""The Responses API through the official openai client: text and streamed events equal the chat
path's greedy reply, a function tool round trip with function_call_output, previous_response_id
over stored responses (bounded), json_schema through structured outputs, 404s naming ids."""

import json

import httpx
import openai
import pytest

from kvserve.server.responses import ResponseStore, input_messages

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0)


def chat_text(client, messages, **kw):
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    return r.choices[0].message.content


def test_text_equals_the_chat_reply(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", instructions="Be brief.",
                                max_output_tokens=20, temperature=0)
    expected = chat_text(client, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "What is the capital of France?"}], max_tokens=20)
    assert r.output_text == expected and r.object == "response"
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status in ("completed", "incomplete") and r.instructions == "Be brief."


def test_a_cut_reply_is_incomplete(client):
    r = client.responses.create(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=5,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def test_stream_events_build_the_same_response(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
              max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_function_tool_round_trip(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=40,
                                    temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    follow = [{"role": "user", "content": "What is the weather in Paris?"}, *[c.model_dump() for c in calls],
              *[{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 24 C"} for c in calls]]
    second = client.responses.create(model=MODEL, input=follow, tools=[WEATHER], max_output_tokens=12,
                                     temperature=0)
    assert second.output_text and second.output[0].type == "message"
    # the result reached the model: a continuation from the stored first response equals it
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                      input=[{"type": "function_call_output", "call_id": c.call_id,
                                              "output": "Sunny, 24 C"} for c in calls],
                                      max_output_tokens=12, temperature=0)
    assert chained.output_text == second.output_text


def test_streamed_function_call_events(client):
    events = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == done.arguments and "city" in json.loads(done.arguments)
    final = events[-1].response
    assert final.output[0].type == "function_call" and final.output[0].arguments == done.arguments


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=10, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=10, temperature=0)
    expected = chat_text(client, [{"role": "user", "content": "My name is Ada."},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "What is my name?"}], max_tokens=10)
    assert second.output_text == expected and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_json_schema_through_structured_outputs(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Describe Paris as JSON.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    body = json.loads(r.output_text)
    assert set(body) == {"city", "is_capital"} and isinstance(body["is_capital"], bool)


def test_unknown_and_unstored_ids_are_404_naming_them(client, smollm2_server):
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError, match="resp_gone"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_gone", max_output_tokens=2)
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    r = httpx.get(f"{smollm2_server.url}/v1/responses/{unstored.id}", timeout=30)
    assert r.status_code == 404 and unstored.id in r.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
])
def test_what_is_not_served_is_a_400_naming_it(smollm2_server, body, param):
    r = httpx.post(smollm2_server.url + "/v1/responses", json={"max_output_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_store_is_bounded_oldest_dropped():
    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert list(store.items) == ["r1", "r2"]
    with pytest.raises(Exception, match="r0"):
        store.get("r0", "previous_response_id")


def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "d"}, {"type": "message", "role": "user", "content": "q"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]}]
    out = input_messages(items)
    assert [m["role"] for m in out] == ["developer", "user", "assistant", "tool"]
    assert [c["id"] for c in out[2]["tool_calls"]] == ["c1", "c2"] and out[3]["content"] == "ok"


def test_openapi_fuzzing_of_responses_finds_no_500(smollm2_server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    op = schemathesis.openapi.from_url(smollm2_server.url + "/openapi.json")["/v1/responses"]["POST"]
    failures, statuses = [], []

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def check(case):
        if isinstance(case.body, dict):
            case.body["max_output_tokens"] = 2
            case.body.pop("previous_response_id", None)
        r = case.call(base_url=smollm2_server.url, timeout=60)
        statuses.append(r.status_code)
        if r.status_code >= 500:
            failures.append((case.body, r.status_code, r.text[:300]))

    check()
    assert not failures, failures[:3]
    assert 400 in statuses
