"""OpenAI request bodies as pydantic models, and their translation to ``SamplingParams``.

Field names are OpenAI's (and vLLM's extensions: ``top_k``, ``min_p``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``). Every model forbids unknown fields, so a field
Weir does not support is a 400 that names it rather than being silently ignored;
the penalties are accepted only at their neutral value 0.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from weir.shared.protocol.client import MAX_ARRAY_LEN
from weir.shared.sampling import MAX_LOGPROBS, SamplingParams

TokenIds = list[Annotated[int, Field(ge=0)]]


def _prompt_form(value: Any) -> str:
    """Which form a prompt takes, told by its first item, so pydantic validates that form
    alone (trying each in turn built an error per item of a long list: 600 MB and a second
    of the event loop for 2M token ids)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "texts"
        if isinstance(value[0], list):
            return "batch"
    return "ids"


def _protocol_sized(value: Any) -> Any:
    """A list the engine's protocol cannot carry is refused before its items are checked."""
    if isinstance(value, list) and len(value) > MAX_ARRAY_LEN:
        raise ValueError(f"{len(value)} items; at most {MAX_ARRAY_LEN}")
    return value


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[TokenIds, Tag("ids")]
    | Annotated[list[TokenIds], Tag("batch")],
    Discriminator(_prompt_form),
    BeforeValidator(_protocol_sized),
]


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """The fields both endpoints share."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: lower first, on an engine started with --policy priority.
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _neutral_only(cls, value: float, info: Any) -> float:
        if value != 0:
            raise ValueError(f"{info.field_name} is not supported (only 0)")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, index: int
    ) -> SamplingParams:
        """The parameters of sample ``index`` of ``n``: with a seed, each sample draws
        from its own (``seed + index``, wrapped into int64) so the ``n`` samples differ yet
        reproduce.
        ``max_tokens=None``: as many as fit after the prompt (the engine knows how many)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=None if self.seed is None else _wrap_int64(self.seed + index),
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
        )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt or a batch (text or token ids)."""

    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: the model's chat template renders ``messages``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1), BeforeValidator(_protocol_sized)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
