"""Tool-call parsing and rendering, without a model: a stream's pieces give what the whole text
gives, wherever the text is cut."""

import json

import pytest

from kvserve.server.tools import (HermesParser, Llama3JsonParser, NamedParser, RequiredParser, Tool,
                                  fallback_messages, forced_schema, plan_tools, template_takes_tools)
from kvserve.tokenizer.base import render_chat_template

WEATHER = Tool("get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"]})
TIME = Tool("get_time", "", {"type": "object", "properties": {}})
TOOLS = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
         for t in (WEATHER, TIME)]


def run(parser, pieces):
    content, calls = "", []
    for p in pieces:
        d = parser.feed(p)
        content, calls = content + d.content, calls + d.calls
    d = parser.finish()
    return content + d.content, calls + d.calls


def merged(deltas):
    """Streamed tool-call deltas put together as a client does: by index, arguments appended."""
    calls = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"name": None, "arguments": ""})
        c["name"] = d.get("function", {}).get("name") or c["name"]
        c["arguments"] += d.get("function", {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


HERMES_TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done <tool')


@pytest.mark.parametrize("cut", range(0, len(HERMES_TEXT) + 1, 3))
def test_hermes_stream_equals_whole_text_at_every_cut(cut):
    whole_content, whole_calls = run(HermesParser([WEATHER, TIME]), [HERMES_TEXT])
    content, calls = run(HermesParser([WEATHER, TIME]), [HERMES_TEXT[:cut], HERMES_TEXT[cut:]])
    assert content == whole_content == "Let me check. \n done <tool"
    assert merged(calls) == merged(whole_calls) == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": "{}"}]


def test_hermes_character_by_character_and_ids():
    parser = HermesParser([WEATHER, TIME])
    content, calls = run(parser, list(HERMES_TEXT))
    assert content == "Let me check. \n done <tool"
    assert [c["index"] for c in calls] == [0, 1] and all(c["id"].startswith("call_") for c in calls)
    assert [c["function"]["name"] for c in parser.calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in parser.calls}) == 2


def test_hermes_leaves_what_is_not_a_call_as_written():
    text = 'a <tool_call>{"name": "unknown", "arguments": {}}</tool_call> b <tool_call>not json</tool_call>'
    assert run(HermesParser([WEATHER]), [text]) == (text, [])


def test_hermes_call_left_open_at_the_end_is_still_a_call():
    content, calls = run(HermesParser([WEATHER]), ['<tool_call>{"name": "get_weather", "arguments": {"city": "X"}}'])
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "X"}


def test_parallel_calls_off_keeps_the_first():
    parser = HermesParser([WEATHER, TIME], max_calls=1)
    _, calls = run(parser, [HERMES_TEXT])
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and len(parser.calls) == 1


def test_llama3_json():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'
    for pieces in ([text], list(text)):
        content, calls = run(Llama3JsonParser([WEATHER, TIME]), pieces)
        assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert run(Llama3JsonParser([WEATHER]), ["Hello ", "there"]) == ("Hello there", [])
    assert run(Llama3JsonParser([WEATHER]), ['{"not": "a call"}'])[1] == []


def test_named_streams_arguments_and_required_parses_the_array():
    content, calls = run(NamedParser(WEATHER), ['{"ci', 'ty": "Oslo"}'])
    assert content == "" and merged(calls) == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert calls[0]["id"].startswith("call_") and "id" not in calls[1]
    assert run(NamedParser(TIME), []) [1][0]["function"] == {"name": "get_time", "arguments": ""}
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Lima"}}]'
    content, calls = run(RequiredParser(), [text[:10], text[10:]])
    assert content == "" and merged(calls) == [{"name": "get_time", "arguments": "{}"},
                                               {"name": "get_weather", "arguments": '{"city": "Lima"}'}]
    assert run(RequiredParser(), ['[{"name": "get_ti'])[0] == '[{"name": "get_ti'  # cut short: content


def test_forced_schemas_accept_exactly_calls_to_the_tools():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(forced_schema([WEATHER, TIME], None, parallel=True))
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "A"}}, {"name": "get_time", "parameters": {}}],
                        schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(forced_schema([WEATHER, TIME], None, parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, one)
    assert json.loads(forced_schema([WEATHER], WEATHER, True)) == WEATHER.parameters


@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "function"}], "auto", "tools: item 0"),
    ([{"type": "retrieval", "function": {"name": "x"}}], "auto", "tools: item 0"),
    (TOOLS + TOOLS[:1], "auto", "given twice"),
    (TOOLS, "sometimes", "tool_choice: must be"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice: 'nope' is not one"),
    (TOOLS, {"type": "function"}, "tool_choice: a named choice"),
    (None, "required", "tool_choice: needs tools"),
])
def test_bad_tool_requests_name_the_field(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        plan_tools(tools, choice, None, "")


def test_plans():
    assert plan_tools(None, None, None, "") is None and plan_tools(TOOLS, "none", None, "") is None
    auto = plan_tools(TOOLS, None, None, "")
    assert auto.mode == "auto" and auto.schema is None and auto.parser_name == "hermes"
    assert plan_tools(TOOLS, "auto", None, "{{ '<|python_tag|>' }}").parser_name == "llama3_json"
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, "")
    assert named.mode == "named" and json.loads(named.schema) == TIME.parameters
    assert json.loads(plan_tools(TOOLS, "required", False, "").schema)["maxItems"] == 1


def test_fallback_writes_tools_and_the_round_trip_into_the_conversation():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}]
    out = fallback_messages(messages, [WEATHER, TIME])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    assert messages[2]["tool_calls"] == [call]  # the request's own messages are left as they were
    assert fallback_messages(messages[1:2], [])[0] == {"role": "user", "content": "Weather in Paris?"}


# the shape of Qwen2.5's and Hermes' templates: tools listed in the system turn when given
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_gets_them():
    assert template_takes_tools(TOOL_TEMPLATE) and not template_takes_tools("{{ messages }}")
    text = render_chat_template(TOOL_TEMPLATE, [{"role": "user", "content": "hi"}], True, TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_weather"' in text
    assert "<|im_start|>system" not in render_chat_template(TOOL_TEMPLATE, [{"role": "user", "content": "hi"}], True)
