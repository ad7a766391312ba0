"""The field policy: OpenAI fields kvserve does not serve, split by whether they would change the
output.

A field that cannot change what kvserve returns (bookkeeping, billing, routing hints, a control
the served models do not have) is accepted whatever its value: the response names it in the
`x-kvserve-ignored-fields` header and the server logs it once per field. A field that would change
the output but is not served is a 400 naming it, unless it asks for nothing (null, empty, or its
default). A field OpenAI does not have is a 400 too. docs/api.md carries both tables.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

from kvserve.config import FieldError

IGNORED_HEADER = "x-kvserve-ignored-fields"

# accepted and reported: why each leaves kvserve's output unchanged
IGNORED: dict[str, str] = {
    "metadata": "key-value tags for the client's own bookkeeping",
    "store": "chat and completions are not stored (the Responses API serves store)",
    "service_tier": "one tier here: every request is served the same way",
    "reasoning_effort": "the served models do not reason before answering",
    "reasoning": "the served models do not reason before answering (the Responses API's form)",
    "safety_identifier": "an end-user id for abuse monitoring",
    "prompt_cache_key": "a routing hint; prefix caching here is automatic, by content",
    "prompt_cache_retention": "cached prefixes are kept by the block pool's eviction order",
    "prompt_cache_options": "cached prefixes are kept by the block pool's eviction order",
    "verbosity": "the served models have no verbosity control",
    "user": "an end-user id for abuse monitoring",
    "prediction": "predicted outputs only speed a reply up; the reply is the same without them",
    "stream_options.include_obfuscation": "a padding field for streams over untrusted links",
    "text.verbosity": "the served models have no verbosity control (the Responses API's form)",
}

# refused unless they ask for nothing: the values that ask for nothing, and why each is refused
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": (("",), "text inserted after the completion (fill-in-the-middle) is not served"),
    "functions": (((),), "the legacy function API: use tools"),
    "function_call": (("none",), "the legacy function API: use tool_choice"),
    "audio": ((), "these models read and write text only"),
    "modalities": ((("text",),), "these models read and write text only"),
    "web_search_options": ((), "no web search here"),
}


class FieldPolicy:
    """Sorts a request's extra fields; logs each ignored field the first time it is seen."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.logged: set[str] = set()

    def report(self, names: Iterable[str]) -> Optional[str]:
        """The header's value for these ignored fields (None: none), logging the new ones."""
        names = sorted(set(names))
        for name in names:
            if name not in self.logged:
                self.logged.add(name)
                self.logger.warning("accepted and ignored the field %r (%s); further requests with it are "
                                    "not logged", name, IGNORED.get(name, "it does not change the output"))
        return ", ".join(names) or None


def check_extra(extra: dict[str, Any], refused: Optional[dict[str, tuple[tuple[Any, ...], str]]] = None
                ) -> list[str]:
    """The ignored fields among a request's extra fields (those the endpoint does not declare); a
    refused or unknown one raises a FieldError naming it. `refused`: the endpoint's table."""
    refused = REFUSED if refused is None else refused
    ignored = []
    for name, value in extra.items():
        if name in IGNORED:
            ignored.append(name)
        elif name in refused:
            if not asks_for_nothing(value, refused[name][0]):
                raise FieldError(name, f"not supported by this server ({refused[name][1]})")
        else:
            raise FieldError(name, "not a field of this endpoint")
    return ignored


def asks_for_nothing(value: Any, defaults: tuple[Any, ...]) -> bool:
    frozen = tuple(value) if isinstance(value, list) else value
    return value is None or value is False or value == {} or frozen in defaults
