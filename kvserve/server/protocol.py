"""OpenAI request bodies (the subset kvserve serves), bounded so no body can ask for the absurd."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from kvserve.core.sampling_params import SamplingParams

MAX_N = 16
MAX_STOP = 8


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = Field(None, max_length=256)
    max_tokens: Optional[StrictInt] = Field(None, ge=1, le=1 << 20)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1, le=1 << 20)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[StrictInt] = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    user: Optional[str] = Field(None, max_length=256)
    cache_salt: Optional[str] = Field(None, max_length=256)
    priority: StrictInt = Field(0, ge=-1000, le=1000)
    ignore_eos: StrictBool = False
    # vLLM's extra parameters for beam search: n beams returned out of best_of (default n)
    use_beam_search: StrictBool = False
    best_of: Optional[StrictInt] = Field(None, ge=1, le=MAX_N)
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    early_stopping: Union[bool, Literal["never"]] = False

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > 256 for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings of at most 256 characters")
        return tuple(stops)

    def sampling_params(self, default_max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            max_tokens=self.max_tokens or default_max_tokens, stop=self.stops(),
            ignore_eos=self.ignore_eos, logprobs=logprobs, use_beam_search=self.use_beam_search,
            beam_width=(self.best_of or self.n) if self.use_beam_search else None,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping)


class CompletionRequest(_Common):
    prompt: Union[str, list[StrictInt]] = Field(..., description="a string or a list of token ids")
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    echo: StrictBool = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=512)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1, le=1 << 20)
