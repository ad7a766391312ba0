"""Tool calling through the official openai client on SmolLM2 (whose template has no tools of its
own, so they are written into the conversation): forced calls (a named function, "required")
always parse and validate; calls the model writes in free text ("auto") come back as tool_calls;
a whole round trip; every case streamed and not, the stream put together equal to the whole."""

import json

import openai
import pytest

from kvserve.core.sampling_params import SamplingParams
from kvserve.server.tools import fallback_messages, parse_tools
from tests.conftest import make_llm

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                          "maxLength": 24}}, "required": ["city"],
                                                          "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)


def both(client, **kw):
    """The response, and the same request streamed, put together as a client does."""
    args = {"model": MODEL, "temperature": 0, "max_tokens": 64, **kw}
    whole = client.chat.completions.create(**args)
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] = (d.function.name if d.function else None) or call["name"]
                call["arguments"] += (d.function.arguments if d.function else None) or ""
            reason = c.finish_reason or reason
    return whole, content, [calls[i] for i in sorted(calls)], reason


def check_same(whole, content, calls, reason):
    choice = whole.choices[0]
    assert (choice.message.content or "") == content and choice.finish_reason == reason
    got = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
    assert got == [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
    assert all(c["id"] and c["id"].startswith("call_") for c in calls)


def test_named_function_is_called_with_valid_arguments(client):
    jsonschema = pytest.importorskip("jsonschema")
    whole, content, calls, reason = both(client, messages=ASK, tools=TOOLS,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    check_same(whole, content, calls, reason)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER)


def test_required_calls_given_tools_only(client):
    jsonschema = pytest.importorskip("jsonschema")
    whole, content, calls, reason = both(client, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=80)
    check_same(whole, content, calls, reason)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_weather", "get_time")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_calls_written_in_free_text_are_parsed(client):
    """"auto": what the model writes is read for <tool_call> tags. The model's text is steered
    into that form here (a regex), the way a tool-trained model writes it by itself."""
    regex = (r'Checking the weather\. <tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "(Paris|Lyon)", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')
    whole, content, calls, reason = both(client, messages=ASK, tools=TOOLS, extra_body={"guided_regex": regex})
    check_same(whole, content, calls, reason)
    message = whole.choices[0].message
    assert message.content == "Checking the weather. " and whole.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments)["city"] in ("Paris", "Lyon")


def test_auto_without_a_call_is_the_reply_to_the_conversation_with_tools(client, smollm2):
    """The model sees the tools (in the system message its template gets) and answers in text."""
    whole, content, calls, reason = both(client, messages=ASK, tools=TOOLS, max_tokens=24)
    check_same(whole, content, calls, reason)
    ref = make_llm(smollm2, num_blocks=64, exact=True).chat(fallback_messages(ASK, parse_tools(TOOLS)),
                                                SamplingParams(temperature=0, max_tokens=24))
    assert whole.choices[0].message.content == ref.outputs[0].text and not calls
    plain = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
    assert whole.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tools took their place
    assert client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24, tools=TOOLS,
                                          tool_choice="none").usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_whole_round_trip(client, smollm2):
    """Call, run the tool, send its result back, get the answer: as an agent loop does."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=64,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    whole, content, calls, reason = both(client, messages=history, tools=TOOLS, max_tokens=24)
    check_same(whole, content, calls, reason)
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.choices[0].message.content
    template_messages = [{"role": "user", "content": ASK[0]["content"]},
                         {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                         {"role": "tool", "content": history[2]["content"], "tool_call_id": call.id}]
    ref = make_llm(smollm2, num_blocks=64, exact=True).chat(fallback_messages(template_messages, parse_tools(TOOLS)),
                                                SamplingParams(temperature=0, max_tokens=24))
    assert whole.choices[0].message.content == ref.outputs[0].text
