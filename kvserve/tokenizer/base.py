"""The tokenizer interface the engine uses, and chat-template rendering.

Content is content: special-token text inside what a client writes (message content, names, tool
calls and results, tool definitions) is encoded as plain text; only the chat template's own
markup yields control tokens, so no message can close its turn and open a system turn. A raw
completion prompt is the client's whole text and keeps its special tokens (as vLLM reads it).
"""

from __future__ import annotations

import re
import secrets
from abc import ABC, abstractmethod
from typing import Any, Iterator, Optional, Sequence

from kvserve.config import FieldError


class Tokenizer(ABC):
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: Optional[str] = None
    bos_token: str = ""
    eos_token: str = ""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def special_tokens(self) -> dict[str, int]:
        """The text of each token that `encode` reads as that token wherever it appears (the
        control tokens a chat template writes), by text. None by default."""
        return {}

    def encode_plain(self, text: str) -> list[int]:
        """text with every special token's text encoded as plain text (no BOS)."""
        return self.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Optional[list[dict[str, Any]]] = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a plain prompt instead")
        return render_chat_template(self.chat_template, messages, add_generation_prompt, tools,
                                    bos_token=self.bos_token, eos_token=self.eos_token)

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """The conversation's tokens: the template writes its own special tokens (a BOS
        included, where it wants one); special-token text the client wrote stays text."""
        text = self.apply_chat_template(messages, tools=tools)
        fence = ContentFence(self.special_tokens)
        if not fence.is_needed(messages, tools):  # the common case: encoded as it always was
            return self.encode(text, add_special_tokens=False)
        marked = self.apply_chat_template(fence.mark(messages), tools=fence.mark(tools))
        ids: list[int] = []
        for piece, token_id in fence.split(marked, text):
            ids += self.encode_plain(piece) if token_id is None else [token_id]
        return ids


class ContentFence:
    r"""Tells the template's special tokens from the client's special-token text. Every special
    token's text inside a client's string is wrapped in a random fence before the template
    renders, so in the rendered text a bare special token is the template's own:

        content   "hi<|im_end|>"   marked  "hiKVO3f..<|im_end|>KVC3f.."
        rendered  <|im_start|>user\nhiKVO3f..<|im_end|>KVC3f..<|im_end|>
        pieces    [<|im_start|>] ["user\nhi<|im_end|>" as text] [<|im_end|>]

    The fences are letters and digits, so they pass through what templates do to content
    (trim, tojson, concatenation) unchanged; a template that changes them (cuts content short,
    upper-cases it) is caught by comparing the rendering without fences with the real one, and
    such a conversation is refused rather than read as markup."""

    REFUSAL = ("the chat template rewrites message text that holds special-token text, so that "
               "text cannot be kept apart from the template's own markup; remove it from the messages")

    def __init__(self, special_tokens: dict[str, int]) -> None:
        self.special_tokens = special_tokens
        nonce = secrets.token_hex(8)  # unguessable: a client cannot write a fence
        self.open, self.close = f"KVO{nonce}", f"KVC{nonce}"
        # longest first: at one position the longest special token wins, as the tokenizer matches
        alternatives = "|".join(re.escape(t) for t in sorted(special_tokens, key=len, reverse=True))
        self._special = re.compile(alternatives or "(?!)")  # (?!) matches nothing; re caches the compiled

    def is_needed(self, *values: Any) -> bool:
        """Whether any string in values (nested lists and dicts, keys too) holds special-token text."""
        return any(self._special.search(s) is not None for s in _strings(values))

    def mark(self, value: Any) -> Any:
        """value with each special token's text in its strings fenced (a copy; nested values too)."""
        if isinstance(value, str):
            return self._special.sub(lambda m: self.open + m.group(0) + self.close, value)
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(v) for v in value]
        return value

    def split(self, marked: str, text: str) -> list[tuple[str, Optional[int]]]:
        """The rendered text as pieces: (text to encode plainly, None) between the template's
        special tokens ("", id). ValueError where the fences did not pass through whole and in
        pairs (then the template's markup and the client's text cannot be told apart)."""
        if marked.replace(self.open, "").replace(self.close, "") != text:
            raise FieldError("messages", self.REFUSAL)
        pieces: list[tuple[str, Optional[int]]] = []
        run, end = "", 0
        fenced = f"{re.escape(self.open)}(?P<content>.*?){re.escape(self.close)}"
        for m in re.finditer(f"{fenced}|{self._special.pattern}", marked, re.DOTALL):
            run += marked[end:m.start()]
            end = m.end()
            if m.group("content") is not None:  # the client's: stays in the run of text
                run += m.group("content")
                continue
            pieces.append((run, None))
            pieces.append(("", self.special_tokens[m.group(0)]))
            run = ""
        pieces.append((run + marked[end:], None))
        if any(self.open in piece or self.close in piece for piece, _ in pieces):  # a fence cut in two
            raise FieldError("messages", self.REFUSAL)
        return [p for p in pieces if p[1] is not None or p[0]]


def _strings(value: Any) -> Iterator[str]:
    """Every string in value, nested lists, tuples and dicts (keys too) included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def render_chat_template(template: str, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
                         tools: Optional[list[dict[str, Any]]] = None, **special: str) -> str:
    """The conversation as the template writes it; `tools` (OpenAI's function list) is given to
    templates that render tools, as transformers' apply_chat_template does."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise ValueError("each chat message needs a string 'role' and a string 'content'")

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, tools=tools, **special)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e
