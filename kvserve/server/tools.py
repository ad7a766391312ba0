"""Tool calling for chat completions: the request's tools put before the model, and the calls it
writes taken back out of its text.

Rendering: a chat template that speaks of `tools` gets them as templates expect (Qwen2.5, Hermes,
Llama 3.1 style); any other template gets them in a system message that asks for Hermes-style
calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and the conversation's earlier
calls and results are written in that form, so tool calling works on every chat model.

Parsing is one object per choice (`ToolCallParser`) fed the text as it arrives, so a stream's
deltas and a whole response come from the same code:
- `tool_choice` "auto": `HermesParser` (or `Llama3JsonParser` for templates of that family) finds
  the calls in free text; text outside them is the message's content;
- a named function: the output is forced (structured outputs) to that function's arguments, and
  `NamedParser` streams it as the arguments of one call;
- "required": the output is forced to a JSON array of {"name", "parameters"} objects naming the
  given tools, and `RequiredParser` turns it into calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence
from kvserve.config import FieldError

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def parse_tools(tools: Sequence[Any]) -> list[Tool]:
    """OpenAI's `tools` list, checked: each {"type": "function", "function": {"name", ...}}."""
    out: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise FieldError("tools", f"item {i} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not name or len(name) > 64:
            raise FieldError("tools", f"item {i} needs a function name of 1 to 64 characters")
        if not isinstance(params, dict):
            raise FieldError("tools", f"the parameters of {name!r} must be a JSON schema object")
        if any(x.name == name for x in out):
            raise FieldError("tools", f"{name!r} is given twice")
        out.append(Tool(name, str(fn.get("description") or ""), params))
    return out


def chosen_tool(tool_choice: Any, tools: Sequence[Tool]) -> Optional[Tool]:
    """The function a named tool_choice forces, checked against the tools given."""
    if not isinstance(tool_choice, dict):
        return None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise FieldError("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    for t in tools:
        if t.name == name:
            return t
    raise FieldError("tool_choice", f"{name!r} is not one of the tools given")


def forced_schema(tools: Sequence[Tool], named: Optional[Tool], parallel: bool) -> Optional[str]:
    """The JSON schema the output is held to: a named function's arguments, or for "required" an
    array of calls to the given tools (one call only when parallel calls are off)."""
    if named is not None:
        return json.dumps(named.parameters)
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                        "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def template_takes_tools(template: str) -> bool:
    return "tools" in template


def default_parser_name(template: str) -> str:
    """The call format a template's model was trained on: Llama 3.1+ templates write
    <|python_tag|> / JSON calls; Hermes and Qwen write <tool_call> tags (our fallback too)."""
    if "<|python_tag|>" in template or ("<|eot_id|>" in template and TOOL_CALL_OPEN not in template):
        return "llama3_json"
    return "hermes"


def fallback_messages(messages: list[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The conversation for a template that knows nothing of tools: the tools described in the
    system message, earlier calls and their results written as Hermes-style tags."""
    listing = "\n".join(json.dumps(t.as_openai()) for t in tools)
    instructions = (
        "You may call one or more functions to assist with the user query. The functions are listed "
        f"within <tools></tools>:\n<tools>\n{listing}\n</tools>\n"
        "For each function call, write a JSON object with the function name and arguments within "
        f'{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} tags:\n{TOOL_CALL_OPEN}\n{{"name": <function-name>, '
        f'"arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}')
    out = [dict(m) for m in messages]
    if tools:
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + instructions
        else:
            out.insert(0, {"role": "system", "content": instructions})
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{TOOL_CALL_OPEN}\n{json.dumps(_call_as_written(c))}\n{TOOL_CALL_CLOSE}"
                              for c in m.pop("tool_calls"))
            m["content"] = (m["content"] + "\n" if m["content"] else "") + calls
        elif m["role"] == "tool":
            m["role"] = "user"
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
            m.pop("tool_call_id", None)
    return out


def _call_as_written(call: Any) -> dict[str, Any]:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return {"name": fn.get("name"), "arguments": args}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier calls as tool-aware templates read them: arguments as objects, not JSON text."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": _call_as_written(c)} if isinstance(c, dict) else c
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ParsedDelta:
    """What a piece of output adds: message content, and tool-call deltas in OpenAI's streamed
    form ({"index", "id", "type", "function": {"name", "arguments"}}, later pieces of one call
    carrying only index and function.arguments)."""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallParser:
    """One choice's output, fed as it arrives; `finish()` once at the end. `calls` holds every
    call made so far, whole; with parallel calls off (max_calls 1) later calls are dropped."""

    def __init__(self, max_calls: Optional[int] = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.max_calls = max_calls

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError

    def _call(self, name: str, arguments: Any) -> list[dict[str, Any]]:
        """The streamed delta of a new call (none when past max_calls)."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return []
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}
        self.calls.append(call)
        # the delta is a copy: a named call's later pieces extend the arguments of `call` itself
        return [{"index": len(self.calls) - 1, **call, "function": dict(call["function"])}]


def _as_call(text: str, names: set[str]) -> Optional[tuple[str, Any]]:
    """(name, arguments) when text is one JSON call to a known tool."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return (obj["name"], args) if isinstance(args, (dict, str)) else None


class HermesParser(ToolCallParser):
    """Calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>; text outside
    the tags is content. Text that may be the start of a tag is held back until it is known; a
    tag whose JSON is not a call to a given tool stays content, as written."""

    def __init__(self, tools: Sequence[Tool], max_calls: Optional[int] = None) -> None:
        super().__init__(max_calls)
        self.names = {t.name for t in tools}
        self.pending = ""  # held back: a possible start of a tag, or an open call
        self.in_call = False

    def feed(self, text: str) -> ParsedDelta:
        self.pending += text
        out = ParsedDelta()
        while True:
            if self.in_call:
                end = self.pending.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return out
                self._close(self.pending[:end], out)
                self.pending = self.pending[end + len(TOOL_CALL_CLOSE):]
                self.in_call = False
                continue
            start = self.pending.find(TOOL_CALL_OPEN)
            if start >= 0:
                out.content += self.pending[:start]
                self.pending = self.pending[start + len(TOOL_CALL_OPEN):]
                self.in_call = True
                continue
            keep = _partial_suffix(self.pending, TOOL_CALL_OPEN)
            out.content += self.pending[:len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.in_call:  # the output ended inside a call (no closing tag): a call if it parses
            self._close(self.pending, out)
        else:
            out.content = self.pending
        self.pending, self.in_call = "", False
        return out

    def _close(self, body: str, out: ParsedDelta) -> None:
        call = _as_call(body.strip(), self.names)
        if call is None:
            out.content += TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if self.in_call else "")
        else:
            out.calls += self._call(*call)


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1+ calls: the whole output a JSON object {"name", "parameters"} (several joined
    by ';'), optionally after <|python_tag|>. Output that starts otherwise is content."""

    def __init__(self, tools: Sequence[Tool], max_calls: Optional[int] = None) -> None:
        super().__init__(max_calls)
        self.names = {t.name for t in tools}
        self.text = ""
        self.decided: Optional[bool] = None  # None until the first non-space character

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        if self.decided is None:
            head = self.text.lstrip().removeprefix("<|python_tag|>").lstrip()
            if not head or "<|python_tag|>".startswith(self.text.lstrip()):
                return ParsedDelta()
            self.decided = head.startswith("{")
            if not self.decided:
                out, self.text = self.text, ""
                return ParsedDelta(content=out)
            return ParsedDelta()
        if self.decided:
            return ParsedDelta()
        out, self.text = self.text, ""
        return ParsedDelta(content=out)

    def finish(self) -> ParsedDelta:
        body, self.text = self.text, ""
        if not self.decided:
            return ParsedDelta(content=body)
        parts = [_as_call(p.strip(), self.names) for p in body.strip().removeprefix("<|python_tag|>").split(";")]
        if not parts or any(p is None for p in parts):
            return ParsedDelta(content=body)
        return ParsedDelta(calls=[d for p in parts if p is not None for d in self._call(*p)])


class NamedParser(ToolCallParser):
    """Output forced to one function's arguments: the call opens with the first piece, and every
    piece of text is the next piece of its arguments."""

    def __init__(self, tool: Tool) -> None:
        super().__init__()
        self.tool = tool
        self.call: Optional[dict[str, Any]] = None

    def feed(self, text: str) -> ParsedDelta:
        if self.call is None:
            delta = self._call(self.tool.name, text)
            self.call = self.calls[-1]
            return ParsedDelta(calls=delta)
        if not text:
            return ParsedDelta()
        self.call["function"]["arguments"] += text
        return ParsedDelta(calls=[{"index": 0, "function": {"arguments": text}}])

    def finish(self) -> ParsedDelta:
        return self.feed("") if self.call is None else ParsedDelta()


class RequiredParser(ToolCallParser):
    """Output forced to a JSON array of {"name", "parameters"}: each call as soon as its object is
    complete, so when the token budget cuts the array the calls before the cut are still calls
    (the cut one is dropped; finish_reason "length" says the output was cut). An output cut
    before any call is complete stays content."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.pos = 0  # where the next item's separator ('[' first, then ',') is looked for
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        out = ParsedDelta()
        while (call := self._next_call()) is not None:
            out.calls += self._call(*call)
        return out

    def finish(self) -> ParsedDelta:
        out = self.feed("")
        if not self.calls:
            out.content = self.text
        return out

    def _next_call(self) -> Optional[tuple[str, Any]]:
        """The next complete item, read past; None until there is one."""
        i = _skip_space(self.text, self.pos)
        if i >= len(self.text) or self.text[i] != ("[" if self.pos == 0 else ","):
            return None
        try:
            obj, end = self.decoder.raw_decode(self.text, _skip_space(self.text, i + 1))
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "parameters" not in obj:
            return None
        self.pos = end
        return obj["name"], obj["parameters"]


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper start of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: the parser each choice gets, and the schema its output
    is held to (forced choices)."""
    tools: tuple[Tool, ...]
    mode: str  # "auto", "required" or "named"
    parser_name: str
    named: Optional[Tool] = None
    schema: Optional[str] = None
    parallel: bool = True

    def parser(self) -> ToolCallParser:
        if self.mode == "named":
            assert self.named is not None
            return NamedParser(self.named)
        if self.mode == "required":
            return RequiredParser()
        return PARSERS[self.parser_name](self.tools, None if self.parallel else 1)


def plan_tools(tools: Optional[Sequence[Any]], tool_choice: Any, parallel: Optional[bool],
               template: str, parser_name: Optional[str] = None) -> Optional[ToolPlan]:
    """The request's tool plan, or None when it calls no tools (no tools, or tool_choice "none")."""
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise FieldError("tool_choice", "must be none, auto, required or a named function")
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise FieldError("tool_choice", f"must be none, auto, required or a named function, got {tool_choice!r}")
    if not tools:
        if tool_choice not in (None, "none"):
            raise FieldError("tool_choice", "needs tools")
        return None
    given = parse_tools(tools)
    if tool_choice == "none":
        return None
    named = chosen_tool(tool_choice, given)
    mode = "named" if named is not None else "required" if tool_choice == "required" else "auto"
    schema = None if mode == "auto" else forced_schema(given, named, parallel is not False)
    if parser_name not in (None, "auto", *PARSERS):
        raise FieldError("tool-call-parser", f"one of auto, {', '.join(PARSERS)}; got {parser_name!r}")
    name = default_parser_name(template) if parser_name in (None, "auto") else parser_name
    return ToolPlan(tuple(given), mode, name, named, schema, parallel is not False)
