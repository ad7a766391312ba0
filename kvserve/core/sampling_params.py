"""SamplingParams: how tokens are chosen and when a sequence stops, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from kvserve.config import OptionError
from kvserve.core.retention import RetentionError, RetentionRange, parse_retention


GREEDY_BELOW = 1e-5
MAX_BIAS = 100.0  # OpenAI's bound on a logit_bias value


STRUCTURED_KINDS = ("json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with (vLLM's LoRARequest): by name, as loaded with
    --lora-modules or at run time; a path not yet loaded is loaded under the name. lora_int_id is
    the engine's id of the loaded adapter (0: let the engine say; another given id must match it)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise OptionError("lora_request", f"needs a non-empty adapter name, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 0:
            raise OptionError("lora_request", f"lora_int_id must be an integer >= 0, got {self.lora_int_id!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Parameters named and bounded as in vLLM and the OpenAI API.

    temperature 0 (or below 1e-5) means greedy. top_k 0 or -1 disables top-k; top_p 1 and min_p 0 disable theirs.
    repetition_penalty (>0, 1 disables) divides positive logits of every token seen in the prompt
    or output and multiplies negative ones; presence and frequency penalties (in [-2, 2]) subtract
    from tokens seen in the output, once or per occurrence.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # number of top logprobs to return per token
    prompt_logprobs: Optional[int] = None  # likewise for every prompt token (vLLM's name)
    include_stop_str_in_output: bool = False
    # beam search (vLLM's and Hugging Face's names): beam_width hypotheses kept, n of them returned
    use_beam_search: bool = False
    beam_width: Optional[int] = None  # default: n
    length_penalty: float = 1.0  # a finished hypothesis scores sum of logprobs / length ** length_penalty
    early_stopping: Union[bool, str] = False  # True, False or "never", as Hugging Face generate()
    # structured outputs: (kind, spec), kind one of STRUCTURED_KINDS; every token is drawn from
    # those that keep the output a prefix of the language (a JSON schema, a regex, a choice, a grammar)
    structured: Optional[tuple[str, str]] = None
    # OpenAI's logit_bias: (token id, bias) pairs added to the logits before any filter or
    # structured-output mask; a dict is taken too and kept sorted by id (a frozen, hashable value)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # retention priorities (kvserve.core.retention): token ranges of the prompt whose cached
    # blocks outlive others; dicts {"start", "end", "priority", "duration_s"?} are taken too
    kv_retention: tuple[RetentionRange, ...] = ()
    # the LoRA adapter the request runs with (None: the base model); a name is taken too
    lora_request: Optional[LoRARequest] = None
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        stop: Union[str, Sequence[str], None] = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        try:
            object.__setattr__(self, "kv_retention", parse_retention(self.kv_retention))
        except RetentionError as e:
            raise OptionError("kv_retention", str(e)) from None
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.lora_request, str):
            object.__setattr__(self, "lora_request", LoRARequest(self.lora_request))
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            raise OptionError("lora_request", f"must be a LoRARequest or an adapter name, got {self.lora_request!r}")
        self._validate()

    def _validate(self) -> None:
        checks = [
            (isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1"),
            (self.structured is None or (isinstance(self.structured, tuple) and len(self.structured) == 2
                                         and self.structured[0] in STRUCTURED_KINDS), "structured",
             f"must be (kind, spec) with kind one of {STRUCTURED_KINDS}"),
            (self.structured is None or (self.n == 1 and not self.use_beam_search), "structured",
             "takes one sample (n = 1, no beam search)"),
            (_is_num(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0"),
            (_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
             "must be -1, 0 (disabled) or a positive integer"),
            (_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty", "must be > 0"),
            (_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "presence_penalty", "must be in [-2, 2]"),
            (_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "frequency_penalty", "must be in [-2, 2]"),
            (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
             and (self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None)),
             "max_tokens", "must be an integer >= 1 (0 only to score the prompt: with prompt_logprobs)"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             "min_tokens", "must be in [0, max_tokens]"),
            (self.seed is None or isinstance(self.seed, int), "seed", "must be an integer"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative integers"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "logprobs", "must be an integer in [0, 20]"),
            (self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and not isinstance(self.prompt_logprobs, bool)
                                              and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs", "must be an integer in [0, 20]"),
            (all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and _is_num(b) and -MAX_BIAS <= b <= MAX_BIAS
                 for t, b in self.logit_bias), "logit_bias",
             f"maps token ids (integers >= 0) to biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise OptionError(name, f"{rule}, got {getattr(self, name)!r}")
        if self.use_beam_search:
            self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        if self.beam_width is None:
            object.__setattr__(self, "beam_width", self.n)
        width = self.beam_width
        checks = [
            (isinstance(width, int) and not isinstance(width, bool) and 1 <= width <= 64, "beam_width",
             "must be an integer in [1, 64]"),
            (isinstance(width, int) and self.n <= width, "n", f"must be at most beam_width ({width})"),
            (self.temperature == 0, "temperature", "must be 0 with beam search (beams are chosen, not sampled)"),
            (_is_num(self.length_penalty), "length_penalty", "must be a number"),
            (self.early_stopping in (True, False, "never"), "early_stopping", 'must be true, false or "never"'),
            (not self.has_penalties and self.top_k in (0, -1) and self.top_p == 1 and self.min_p == 0,
             "use_beam_search", "takes no penalties or top-k/top-p/min-p filters"),
            (not self.logit_bias, "use_beam_search", "takes no logit_bias (beams are scored by the model's logprobs)"),
            (not self.stop and self.min_tokens == 0 and self.logprobs is None, "use_beam_search",
             "takes no stop strings, min_tokens or logprobs"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise OptionError(name, f"{rule}, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or one so small that dividing by it overflows (below 1e-5, as vLLM):
        both mean the most likely token."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (id, bias) pairs, from a dict {id: bias} or pairs; the values are
    checked by _validate, anything that is not pairs is refused here by name."""
    if bias is None:
        return ()
    items: Any = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(t, b) for t, b in items]
    except (TypeError, ValueError):
        raise OptionError("logit_bias", f"must map token ids to biases, got {bias!r}") from None
    if any(not isinstance(t, int) for t, _ in pairs):
        raise OptionError("logit_bias", f"keys must be integer token ids, got {bias!r}")
    return tuple(sorted(pairs))


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
