"""The tokenizer interface the engine uses, and chat-template rendering."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional, Sequence


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

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Optional[list[dict[str, Any]]] = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a plain prompt instead")
        return render_chat_template(self.chat_template, messages, add_generation_prompt, tools,
                                    bos_token=self.bos_token, eos_token=self.eos_token)

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
        # the template writes its own special tokens (a BOS included, where it wants one)
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


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
